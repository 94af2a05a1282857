"""Calibrating a served model (``ModelSlot.calibrate``, POST /calibration/start and apply):
the matrix is what ``compute_imatrix`` makes of the same chunks on the same model, whatever the
model serves meanwhile; applying it holds what a load under ``--isq METHOD --imatrix`` builds;
/re_isq afterwards keeps the matrix; one calibration or re-quantization at a time, and a refused
one changes nothing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from inferd.config import EngineConfig
from inferd.engine.driver import EngineLoop
from inferd.engine.sampling import SamplingParams
from inferd.loading.calibration import compute_imatrix
from inferd.loading.imatrix import ImatrixError
from inferd.loading.model import load
from inferd.server.app import build_app
from inferd.serving.calibration import Calibration, CalibrationState
from inferd.serving.interface import RequestOutput
from inferd.serving.registry import ConflictError, ModelSlot, ModelStatus
from inferd.serving.served import ServedModel, load_model
from inferd.source import resolve_source
from tests.models.tiny import CORPUS, save_tiny
from tests.test_requantize import assert_same_weights, weights

TEXT = " ".join(CORPUS)
CHUNK, CHUNKS = 16, 3
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPT = [5, 17, 42, 99, 3]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("calibration")
    save_tiny("llama", directory)  # its own output head: calibrated and quantized too
    return directory


def _served(directory: Path, loop: EngineLoop | None = None) -> ServedModel:
    cfg = EngineConfig(dtype="f32", kv_cache_tokens=256)
    return load_model(resolve_source(str(directory)), cfg, progress=False, loop=loop)


@pytest.fixture
def served(tiny_dir: Path) -> Iterator[ServedModel]:
    model = _served(tiny_dir)
    yield model
    model.shutdown()


class HeldLoop(EngineLoop):
    """Nothing steps the engine: calls made between steps wait until the test runs them
    (``AsyncEngine.run_once``), and from ``release`` on run at once where they are made."""

    def __init__(self) -> None:
        super().__init__()
        self.released = False

    def on_loop_thread(self) -> bool:
        return self.released

    def release(self) -> None:
        self.released = True


async def _tokens(stream: AsyncIterator[RequestOutput]) -> list[int]:
    return [t async for out in stream for t in out.token_ids]


async def _calibrate(slot: ModelSlot) -> Calibration:
    return await slot.calibrate(TEXT, chunk_size=CHUNK, max_chunks=CHUNKS, dataset="corpus")


def test_the_matrix_is_compute_imatrix_of_the_same_chunks_whatever_runs_meanwhile(
    served: ServedModel, tiny_dir: Path
) -> None:
    slot = ModelSlot.of_loaded(served)

    async def run() -> tuple[Calibration, list[int], list[int]]:
        alone = await _tokens(served.engine.submit(PROMPT, GREEDY))
        running = served.engine.submit(PROMPT, GREEDY)  # its steps go on between the chunks
        calibration = await _calibrate(slot)
        assert calibration.running and served.calibration is calibration
        meanwhile = await _tokens(running)
        await calibration.wait()
        return calibration, alone, meanwhile

    calibration, alone, meanwhile = asyncio.run(run())
    assert meanwhile == alone  # the request was served as if no calibration ran
    assert calibration.state is CalibrationState.DONE and calibration.error is None
    imatrix = calibration.imatrix
    assert imatrix is not None
    want = compute_imatrix(
        served.engine.engine.model,
        served.tokenizer,
        TEXT,
        chunk_size=CHUNK,
        max_chunks=CHUNKS,
        dataset="corpus",
        progress=False,
    )
    assert imatrix.digest() == want.digest()
    assert (imatrix.datasets, imatrix.chunk_count, imatrix.chunk_size) == (("corpus",), 3, 16)
    status = calibration.status()
    projections = 2 * 4 + 1  # two layers' four projections and the untied head
    assert status == {
        "state": "done",
        "chunks_done": CHUNKS,
        "chunks_total": CHUNKS,
        "chunk_size": CHUNK,
        "tokens": CHUNKS * CHUNK,
        "dataset": "corpus",
        "imatrix": f"sha256:{imatrix.digest()}",
        "collecting": False,
        "layers": projections,
        "layers_tracking": projections,
        "total_rows": projections * CHUNKS * CHUNK,
        "min_rows": CHUNKS * CHUNK,
        "max_rows": CHUNKS * CHUNK,
    }


def test_applied_it_holds_what_a_load_under_isq_with_imatrix_builds(
    served: ServedModel, tiny_dir: Path
) -> None:
    """q8 for the matrix (ModelSlot.requantize, as /calibration/apply calls it), then q4 with
    no matrix named (as /re_isq calls it): the matrix is kept."""
    slot = ModelSlot.of_loaded(served)

    async def run() -> Calibration:
        calibration = await _calibrate(slot)
        await calibration.wait()
        assert calibration.imatrix is not None
        await slot.requantize("q8", 600, calibration.imatrix)
        return calibration

    imatrix = asyncio.run(run()).imatrix
    assert imatrix is not None and served.imatrix is imatrix and served.isq == "q8"
    model = served.engine.engine.model
    assert_same_weights(model, load(tiny_dir, dtype="f32", isq="q8", imatrix=imatrix).model)
    plain = weights(load(tiny_dir, dtype="f32", isq="q8").model)  # the matrix matters
    assert any(not v.equal(plain[k]) for k, v in weights(model).items() if "<scales>" in k)

    report = asyncio.run(slot.requantize("q4", 600))
    assert (report.change.previous, report.change.method) == ("q8", "q4")
    assert served.imatrix is imatrix
    assert_same_weights(model, load(tiny_dir, dtype="f32", isq="q4", imatrix=imatrix).model)


def test_one_calibration_at_a_time_and_no_requantizing_meanwhile(tiny_dir: Path) -> None:
    """Through the routes (in-process), the engine stepped by the test: while the chunks wait,
    a second start, an apply, a download and /re_isq are 409s that change nothing."""
    loop = HeldLoop()
    served = _served(tiny_dir, loop)
    body = {"text": TEXT, "chunk_size": CHUNK, "chunks": CHUNKS}

    async def run() -> tuple[list[httpx.Response], Calibration]:
        transport = httpx.ASGITransport(app=build_app([served]))  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            started = await client.post("/calibration/start", json=body)
            assert started.status_code == 200, started.text
            assert (started.json()["state"], started.json()["chunks_done"]) == ("running", 0)
            first = served.calibration
            assert first is not None
            refused = [
                await client.post("/calibration/start", json=body),
                await client.post("/calibration/apply", json={"isq": "q8"}),
                await client.get("/calibration/imatrix"),
                await client.post("/re_isq", json={"isq": "q8"}),
            ]
            assert served.calibration is first and served.isq is None
            while first.running:  # its chunks, one engine call each
                await asyncio.to_thread(served.engine.run_once)
                await asyncio.sleep(0)
            done = (await client.get("/calibration/status")).json()
            assert (done["state"], done["chunks_done"]) == ("done", CHUNKS)
            again = await client.post("/calibration/start", json=body)  # once done, another
            assert again.status_code == 200 and served.calibration is not first
            # Its task queues the first chunk when it first runs; released before that, the
            # chunks would run at once, where the release made the test thread the loop's.
            while not served.engine._inbox.calls:
                await asyncio.sleep(0)
        loop.release()  # the shutdown retires the engine here, failing the queued chunk
        await asyncio.to_thread(served.shutdown)
        second = served.calibration
        assert second is not None
        await second.wait()
        return refused, second

    refused, second = asyncio.run(run())
    assert [r.status_code for r in refused] == [409] * 4
    conflict, not_done = "model_status_conflict", "calibration_not_done"
    assert [r.json()["error"]["code"] for r in refused] == [conflict, not_done, not_done, conflict]
    assert "being calibrated already" in refused[0].json()["error"]["message"]
    assert "it is running" in refused[1].json()["error"]["message"]
    assert "being calibrated" in refused[3].json()["error"]["message"]
    assert second.state is CalibrationState.FAILED and second.imatrix is None
    assert second.error is not None and "unloaded" in second.error


def test_no_calibration_starts_while_the_model_is_requantized(tiny_dir: Path) -> None:
    loop = HeldLoop()
    served = _served(tiny_dir, loop)
    slot = ModelSlot.of_loaded(served)

    async def run() -> None:
        swap = asyncio.create_task(slot.requantize("q8", 600))
        while slot.status is not ModelStatus.REQUANTIZING:  # made, the swap waits on the engine
            await asyncio.sleep(0.01)
        with pytest.raises(ConflictError, match="is requantizing"):
            await _calibrate(slot)
        while not swap.done():
            await asyncio.to_thread(served.engine.run_once)
            await asyncio.sleep(0)
        await swap

    asyncio.run(run())
    assert served.calibration is None and served.isq == "q8"
    loop.release()
    served.shutdown()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"chunk_size": 10_000}, "longer than the model's context"),
        ({"chunk_size": CHUNK, "text": "too short"}, "fewer than one chunk"),
        ({"chunk_size": 0}, "at least 1 token"),
    ],
)
def test_a_text_without_a_whole_chunk_is_refused(
    served: ServedModel, options: dict[str, Any], message: str
) -> None:
    slot = ModelSlot.of_loaded(served)
    text = options.pop("text", TEXT)
    with pytest.raises(ImatrixError, match=message):
        asyncio.run(slot.calibrate(text, **options))
    assert served.calibration is None


def test_a_calibration_given_up_leaves_the_shutdown_whole(tiny_dir: Path) -> None:
    """Its task cancelled with a chunk queued (as when a server's event loop ends first): the
    shutdown refuses the queued chunks and skips the one nobody waits for."""
    loop = HeldLoop()
    served = _served(tiny_dir, loop)
    calibration = asyncio.run(_calibrate(ModelSlot.of_loaded(served)))  # the loop ends here
    assert calibration.running
    loop.release()
    served.shutdown()
