"""EmbeddingModel: a sentence-embedding model (a BERT encoder + pooling) ready to serve.

Texts are tokenized with the model's ``tokenizer.json``; token-id inputs are taken as given.
A batch is sorted by length and run in sub-batches padded to their longest member, so one
long input does not make every short one pay for its padding. Forward passes run where the
model's loop owner steps it (engine/driver.py: the main thread under `inferd serve`, a thread of
its own when embedded), one call per step, never on the event loop.

Pooling follows the sentence-transformers files beside the weights: ``modules.json`` names a
Pooling module (its ``config.json`` says cls / mean / max / mean-sqrt-len / last-token) and
whether a Normalize module follows. Without those files: mean pooling, then L2 normalization.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from inferd.engine.driver import EngineLoop, ThreadLoop
from inferd.models.bert import BertConfig, BertModel
from inferd.source import ModelSource

log = logging.getLogger(__name__)

POOLING_MODES = ("cls_token", "max_tokens", "mean_tokens", "mean_sqrt_len_tokens", "lasttoken")
SUB_BATCH = 32  # sequences per forward pass


class EmbeddingInputError(ValueError):
    """An input this model cannot embed; ``param`` names the offending request field."""

    def __init__(self, message: str, param: str = "input", code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class Pooling:
    modes: tuple[str, ...] = ("mean_tokens",)  # concatenated in this order
    normalize: bool = True

    @classmethod
    def from_directory(cls, directory: Path) -> Pooling:
        modules_file = directory / "modules.json"
        if not modules_file.is_file():
            return cls()
        modules = json.loads(modules_file.read_text())
        kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules}
        normalize = "Normalize" in kinds
        pool = kinds.get("Pooling")
        if pool is None:
            return cls(normalize=normalize)
        cfg = json.loads((directory / pool.get("path", "") / "config.json").read_text())
        modes = tuple(m for m in POOLING_MODES if cfg.get(f"pooling_mode_{m}"))
        unsupported = [
            k.removeprefix("pooling_mode_")
            for k, v in cfg.items()
            if k.startswith("pooling_mode_")
            and v
            and k.removeprefix("pooling_mode_") not in POOLING_MODES
        ]
        if unsupported:
            raise ValueError(f"pooling mode {', '.join(unsupported)} is not supported")
        if not modes:
            raise ValueError(f"{directory / pool.get('path', '')}: no pooling mode is enabled")
        return cls(modes=modes, normalize=normalize)

    def __call__(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B, T, H] hidden states and [B, T] mask -> [B, H * len(modes)]."""
        m = mask.to(hidden.dtype).unsqueeze(-1)  # [B, T, 1]
        lengths = m.sum(1).clamp(min=1)  # [B, 1]
        parts = []
        for mode in self.modes:
            if mode == "cls_token":
                parts.append(hidden[:, 0])
            elif mode == "max_tokens":
                parts.append(hidden.masked_fill(m == 0, float("-inf")).amax(1))
            elif mode == "mean_tokens":
                parts.append((hidden * m).sum(1) / lengths)
            elif mode == "mean_sqrt_len_tokens":
                parts.append((hidden * m).sum(1) / lengths.sqrt())
            else:  # lasttoken: the last non-padding position
                last = mask.sum(1).long() - 1
                parts.append(hidden[torch.arange(hidden.shape[0]), last])
        pooled = torch.cat(parts, dim=-1)
        return F.normalize(pooled, p=2, dim=-1) if self.normalize else pooled


@dataclass(slots=True)
class _EmbedJob:
    inputs: Sequence[Sequence[int]]
    event_loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[list[float]]]


@dataclass(eq=False)
class EmbeddingModel:
    """A loaded embedding model. ``embed`` is synchronous; ``embed_async`` queues the call for
    the model's loop owner (``loop``) to run. Both take token-id sequences (see ``tokenize``)."""

    kind: ClassVar[str] = "embedding"
    modalities: ClassVar[dict[str, list[str]]] = {"input": ["text"], "output": ["embedding"]}

    source: ModelSource
    config: BertConfig
    model: BertModel
    tokenizer: Any  # tokenizers.Tokenizer, truncation and padding off
    pooling: Pooling
    dtype: torch.dtype
    created: int = field(default_factory=lambda: int(time.time()))
    max_input_tokens: int | None = None  # None: the model's position count
    sub_batch: int = SUB_BATCH
    loop: EngineLoop = field(default_factory=lambda: ThreadLoop("inferd-embed"), repr=False)
    _jobs: deque[_EmbedJob] = field(default_factory=deque, init=False, repr=False)
    _in_flight: int = field(default=0, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _closed: bool = field(default=False, init=False, repr=False)
    _retired: threading.Event = field(default_factory=threading.Event, init=False, repr=False)

    def __post_init__(self) -> None:
        self.loop.register(self)

    @property
    def id(self) -> str:
        return self.source.name

    @property
    def max_model_len(self) -> int:
        """The most tokens (special tokens included) one input may have."""
        return self.max_input_tokens or self.config.max_position

    @property
    def dimensions(self) -> int:
        return self.config.hidden_size * len(self.pooling.modes)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids with the model's special tokens ([CLS] ... [SEP] for BERT)."""
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=True)]

    def check(self, inputs: Sequence[Sequence[int]]) -> None:
        """EmbeddingInputError naming the first input that is empty, too long or out of vocab."""
        limit = self.max_model_len
        for i, ids in enumerate(inputs):
            where = "input" if len(inputs) == 1 else f"input[{i}]"
            if not ids:
                raise EmbeddingInputError(f"{where} is empty; send at least one token")
            if len(ids) > limit:
                raise EmbeddingInputError(
                    f"{where} has {len(ids)} tokens, but {self.id} takes at most {limit} "
                    f"tokens per input (special tokens included); shorten or split it",
                    code="context_length_exceeded",
                )
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise EmbeddingInputError(
                    f"{where} holds token id {bad}, outside this model's vocabulary "
                    f"[0, {self.vocab_size})"
                )

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        """One vector per input, in input order."""
        self.check(inputs)
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        out: list[list[float]] = [[] for _ in inputs]
        with torch.inference_mode():
            for start in range(0, len(order), self.sub_batch):
                chunk = order[start : start + self.sub_batch]
                vectors = self._forward([inputs[i] for i in chunk])
                for i, vec in zip(chunk, vectors, strict=True):
                    out[i] = vec
        return out

    async def embed_async(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        event_loop = asyncio.get_running_loop()
        job = _EmbedJob(inputs, event_loop, event_loop.create_future())
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the embedding model {self.id} is shut down")
            self._in_flight += 1
            self._jobs.append(job)
        self.loop.wake.set()
        try:
            return await job.future
        finally:
            with self._lock:
                self._in_flight -= 1

    def run_once(self) -> bool:
        """The loop owner's step: run one queued ``embed_async`` call; True if there was one."""
        with self._lock:
            if self._closed:
                self._retire_locked()
                return True
            job = self._jobs.popleft() if self._jobs else None
        if job is None:
            return False
        if job.future.cancelled():  # its caller left while it waited
            return True
        try:
            result = self.embed(job.inputs)
        except Exception as exc:  # the caller gets it; the loop goes on
            _settle(job, exc)
        else:
            _settle(job, result)
        return True

    def _forward(self, batch: Sequence[Sequence[int]]) -> list[list[float]]:
        longest = max(len(ids) for ids in batch)
        pad = self.config.pad_token_id
        ids = torch.full((len(batch), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, seq in enumerate(batch):
            ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, : len(seq)] = 1
        hidden = self.model(ids, mask)  # [B, T, H]
        pooled = self.pooling(hidden.float(), mask)
        rows: list[list[float]] = pooled.tolist()
        return rows

    def shutdown(self, timeout: float = 10.0) -> None:
        """Fail the queued calls and leave the loop owner (between two of its steps)."""
        with self._lock:
            self._closed = True
            if self.loop.on_loop_thread():
                self._retire_locked()
        self.loop.wake.set()
        self._retired.wait(timeout)

    def _retire_locked(self) -> None:
        if self._retired.is_set():
            return
        self.loop.unregister(self)
        while self._jobs:
            _settle(self._jobs.popleft(), RuntimeError(f"the embedding model {self.id} shut down"))
        self._retired.set()


def _settle(job: _EmbedJob, outcome: list[list[float]] | BaseException) -> None:
    """Hand a result or an error to the job's event loop (from the loop owner's thread)."""

    def done() -> None:
        if job.future.done():
            return
        if isinstance(outcome, BaseException):
            job.future.set_exception(outcome)
        else:
            job.future.set_result(outcome)

    with contextlib.suppress(RuntimeError):  # the caller's event loop is closed: nobody waits
        job.event_loop.call_soon_threadsafe(done)
