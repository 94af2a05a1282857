"""Engines stepped on the main thread by the driver, as `inferd serve` runs them."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from inferd.config import EngineConfig
from inferd.engine import driver
from inferd.engine.sampling import SamplingParams
from inferd.serving.served import ServedModel, load_model
from inferd.source import resolve_source

PARAMS = SamplingParams(max_tokens=12, temperature=0)


async def _text(served: ServedModel, prompt: list[int]) -> str:
    return "".join([o.text async for o in served.engine.generate(prompt, PARAMS)])


def test_driver_steps_engines_on_the_main_thread_with_the_same_text(
    smollm2_gguf: Path, served_f32: ServedModel
) -> None:
    prompt = served_f32.chat_prompt([{"role": "user", "content": "Name a color."}])
    expected = asyncio.run(_text(served_f32, prompt))  # thread mode
    engines = driver.activate()
    try:
        served = load_model(
            resolve_source(str(smollm2_gguf)),
            EngineConfig(dtype="f32", kv_cache_tokens=2048),
            progress=False,
        )
    finally:
        driver.deactivate()
    assert served.engine._thread is None  # registered with the driver instead
    results: list[str] = []
    caller = threading.Thread(target=lambda: results.append(asyncio.run(_text(served, prompt))))
    caller.start()
    engines.run(lambda: not caller.is_alive())
    assert results == [expected]
    stopper = threading.Thread(target=served.shutdown)  # from another thread: retired by the driver
    stopper.start()
    engines.run(lambda: not stopper.is_alive())
    assert served.engine._retired.is_set()
