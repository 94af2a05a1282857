"""Loop owners: engines stepped on the main thread by the driver (as `inferd serve` runs them),
on a thread of their own, or by the caller; the same text whichever steps them."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from inferd.config import EngineConfig
from inferd.engine.driver import CallerLoop, MainThreadDriver
from inferd.engine.sampling import SamplingParams
from inferd.serving.loading import load_embedding_model
from inferd.serving.served import ServedModel, load_model
from inferd.source import resolve_source

PARAMS = SamplingParams(max_tokens=12, temperature=0)


async def _text(served: ServedModel, prompt: list[int]) -> str:
    return "".join([o.text async for o in served.engine.generate(prompt, PARAMS)])


def test_driver_steps_engines_on_the_main_thread_with_the_same_text(
    smollm2_gguf: Path, minilm_dir: Path, served_f32: ServedModel
) -> None:
    prompt = served_f32.chat_prompt([{"role": "user", "content": "Name a color."}]).ids
    expected = asyncio.run(_text(served_f32, prompt))  # a thread of its own
    engines = MainThreadDriver()
    served = load_model(
        resolve_source(str(smollm2_gguf)),
        EngineConfig(dtype="f32", kv_cache_tokens=2048),
        progress=False,
        loop=engines,
    )
    embedder = load_embedding_model(resolve_source(str(minilm_dir)), loop=engines)
    assert engines.num_engines == 2  # both kinds registered with the one loop owner
    steppers: set[str] = set()
    real_embed = embedder.embed

    def embed(inputs):  # type: ignore[no-untyped-def]
        steppers.add(threading.current_thread().name)
        return real_embed(inputs)

    embedder.embed = embed  # type: ignore[method-assign]
    results: list[object] = []

    async def both() -> None:
        results.append(await _text(served, prompt))
        results.append(await embedder.embed_async(embedder.tokenize(["a red door"])))

    caller = threading.Thread(target=lambda: asyncio.run(both()))
    caller.start()
    engines.run(lambda: not caller.is_alive())
    assert results[0] == expected
    assert steppers == {threading.main_thread().name}  # the embedder ran on the driver's thread
    stopper = threading.Thread(target=lambda: (served.shutdown(), embedder.shutdown()))
    stopper.start()  # from another thread: retired by the driver between steps
    engines.run(lambda: not stopper.is_alive())
    assert engines.num_engines == 0


def test_caller_loop_leaves_the_synchronous_engine_to_its_caller(
    smollm2_gguf: Path, served_f32: ServedModel
) -> None:
    prompt = served_f32.chat_prompt([{"role": "user", "content": "Name a color."}]).ids
    expected = asyncio.run(_text(served_f32, prompt))
    served = load_model(
        resolve_source(str(smollm2_gguf)),
        EngineConfig(dtype="f32", kv_cache_tokens=2048),
        progress=False,
        loop=CallerLoop(),
    )
    engine = served.engine.engine
    engine.add_request("a", prompt, PARAMS)
    text = ""
    while engine.has_unfinished():
        text += "".join(o.text for o in engine.step())
    assert text == expected
    assert engine.stats().kv_blocks_used == 0
    served.shutdown()
