"""Calibrating a served model: its importance matrix from a text, made while it serves
(``POST /calibration/start``, ``ModelSlot.calibrate``; loading/imatrix.py says what the matrix
is, and ``POST /calibration/apply`` re-quantizes with it).

The text is cut into chunks as ``inferd imatrix`` cuts it (loading/calibration.py: each chunk
read from BOS as a sequence of its own, on a KV cache of its own), and the chunks run one at a
time through the served model on its engine's thread, each between two engine steps
(``AsyncEngine.between_steps``) with an ``ImatrixCollector`` started for that chunk alone. So
the requests the model serves meanwhile go on between chunks (each waits at most one chunk's
prefill) and are never observed: the matrix depends on the text and the weights alone, the one
``compute_imatrix`` makes of the same chunks on the same model. mistral.rs's calibration
observes live traffic instead; a matrix from whatever users happened to send is neither
reproducible nor a text one chose, so here the text is the caller's.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import tempfile
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from inferd.engine.async_engine import AsyncEngine, EngineStoppedError
from inferd.engine.llm_engine import LLMEngine
from inferd.loading.calibration import calibration_chunks, read_chunk
from inferd.loading.imatrix import Imatrix, ImatrixCollector, ImatrixError
from inferd.loading.imatrix_file import write_imatrix
from inferd.loading.quantize import linear_modules
from inferd.loading.tokenizer import TokenizerBundle
from inferd.models.llama import LlamaForCausalLM
from inferd.store import default_home

log = logging.getLogger(__name__)

# A saved matrix's name in the store (``<home>/imatrix/<name>.gguf``): no path, no dot first.
_STORE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


class CalibrationState(StrEnum):
    IDLE = "idle"  # never started on this model (a reload forgets the last one)
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


@dataclass(slots=True)
class Calibration:
    """One calibration of a served model: its chunks, how far it got, and the matrix once
    done. Its state changes on the event loop (``run``); ``rows`` on the engine's thread."""

    chunks: list[list[int]]
    chunk_size: int
    dataset: str  # the text's name, recorded in the matrix (llama.cpp's imatrix.datasets)
    collector: ImatrixCollector
    rows: dict[str, int]  # the tokens each projection has read so far
    state: CalibrationState = CalibrationState.RUNNING
    chunks_done: int = 0
    imatrix: Imatrix | None = None
    error: str | None = None
    _task: asyncio.Task[None] | None = field(default=None, repr=False)

    @classmethod
    def of_text(
        cls,
        model: LlamaForCausalLM,
        tokenizer: TokenizerBundle,
        text: str,
        *,
        chunk_size: int,
        max_len: int,
        max_chunks: int | None = None,
        dataset: str = "",
    ) -> Calibration:
        """A calibration of ``model`` on ``text`` (tokenized here: run it off the event loop);
        ImatrixError for a chunk longer than the model's context ``max_len``, or a text that
        holds no whole chunk."""
        if chunk_size > max_len:
            raise ImatrixError(
                f"a chunk of {chunk_size} tokens is longer than the model's context ({max_len})"
            )
        chunks = calibration_chunks(tokenizer, text, chunk_size, max_chunks)
        rows = {name: 0 for name, _ in linear_modules(model)}
        return cls(chunks, chunk_size, dataset, ImatrixCollector(model), rows)

    @property
    def running(self) -> bool:
        return self.state is CalibrationState.RUNNING

    async def wait(self) -> None:
        """Until the calibration has finished (done or failed)."""
        if self._task is not None:
            await asyncio.shield(self._task)

    def start(self, engine: AsyncEngine) -> None:
        """Run the chunks on ``engine``'s model, from the running event loop (a task)."""
        self._task = asyncio.get_running_loop().create_task(self._run(engine))

    async def _run(self, engine: AsyncEngine) -> None:
        try:
            for chunk in self.chunks:
                read = functools.partial(self._read, chunk)
                await asyncio.wrap_future(engine.between_steps(read))
            datasets = (self.dataset,) if self.dataset else ()
            self.imatrix = self.collector.imatrix(datasets, len(self.chunks), self.chunk_size)
            self.state = CalibrationState.DONE
        except EngineStoppedError:
            self._fail("the model was unloaded while it was being calibrated")
        except Exception as exc:  # the model's own failure: reported by status, not raised
            log.exception("calibration failed")
            self._fail(f"{type(exc).__name__}: {exc}")

    def _read(self, chunk: list[int], engine: LLMEngine) -> None:
        read_chunk(engine.model, self.collector, chunk)
        self.chunks_done += 1
        self.rows = self.rows | self.collector.counts()

    def _fail(self, error: str) -> None:
        self.state, self.error = CalibrationState.FAILED, error

    def status(self) -> dict[str, Any]:
        """``calibration_status`` of this calibration, its dataset and its matrix once done."""
        out = _status(self.state, self.chunks_done, len(self.chunks), self.chunk_size, self.rows)
        out["dataset"] = self.dataset
        if self.imatrix is not None:
            out["imatrix"] = f"sha256:{self.imatrix.digest()}"
        if self.error is not None:
            out["error"] = self.error
        return out


def idle_status() -> dict[str, Any]:
    """The status of a model never calibrated (since it was loaded)."""
    return _status(CalibrationState.IDLE, 0, 0, 0, {})


def _status(
    state: CalibrationState, done: int, total: int, chunk_size: int, rows: dict[str, int]
) -> dict[str, Any]:
    """inferd's account (``state``, chunks, tokens) and mistral.rs's ``CalibrationStatus``
    fields (``collecting``: running; ``layers``: the projections observed; ``layers_tracking``:
    those that have read tokens; their rows)."""
    read = [n for n in rows.values() if n > 0]
    return {
        "state": str(state),
        "chunks_done": done,
        "chunks_total": total,
        "chunk_size": chunk_size,
        "tokens": done * chunk_size,
        "collecting": state is CalibrationState.RUNNING,
        "layers": len(rows),
        "layers_tracking": len(read),
        "total_rows": sum(read),
        "min_rows": min(read, default=0),
        "max_rows": max(read, default=0),
    }


def store_imatrix_path(name: str, home: Path | None = None) -> Path:
    """Where the store keeps a matrix saved as ``name``: ``<home>/imatrix/<name>.gguf``.
    ImatrixError for a name that is not a plain file name."""
    if not _STORE_NAME.fullmatch(name):
        raise ImatrixError(
            f"{name[:40]!r} is not a name for the store: 1 to 128 letters, digits, _ . -, "
            "starting with a letter or digit"
        )
    return (home or default_home()) / "imatrix" / f"{name}.gguf"


def save_imatrix(imatrix: Imatrix, path: Path, architecture: str) -> None:
    """Write ``imatrix`` as llama.cpp's GGUF file at ``path``, its folder made if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_imatrix(imatrix, path, architecture)


def imatrix_gguf(imatrix: Imatrix, architecture: str) -> bytes:
    """``imatrix`` as the bytes of llama.cpp's GGUF file (gguf-py writes to a path)."""
    with tempfile.TemporaryDirectory(prefix="inferd-imatrix-") as folder:
        path = Path(folder) / "imatrix.gguf"
        write_imatrix(imatrix, path, architecture)
        return path.read_bytes()
