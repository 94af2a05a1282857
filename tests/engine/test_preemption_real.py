"""A KV pool too small for the load: requests are preempted, recomputed, and still exact."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferd.config import EngineConfig
from inferd.engine.sampling import SamplingParams
from inferd.serving.served import ServedModel, load_model
from inferd.source import resolve_source


@pytest.fixture(scope="module")
def tiny_pool(smollm2_gguf: Path) -> Iterator[ServedModel]:
    cfg = EngineConfig(dtype="f32", max_num_seqs=4, kv_cache_tokens=160, block_size=16)
    served = load_model(resolve_source(str(smollm2_gguf)), cfg, progress=False)
    yield served
    served.shutdown()


async def _text(served: ServedModel, prompt: list[int], params: SamplingParams) -> str:
    return "".join([o.text async for o in served.engine.generate(prompt, params)])


def test_preempted_requests_finish_with_their_solo_text_and_free_everything(
    tiny_pool: ServedModel,
) -> None:
    prompts = [
        tiny_pool.chat_prompt([{"role": "user", "content": f"Describe the number {k}."}])
        for k in range(4)
    ]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    async def solo() -> list[str]:
        return [await _text(tiny_pool, p, params) for p in prompts]

    async def together() -> list[str]:
        return list(await asyncio.gather(*(_text(tiny_pool, p, params) for p in prompts)))

    alone = asyncio.run(solo())
    before = tiny_pool.engine.stats().preemptions
    assert asyncio.run(together()) == alone
    stats = tiny_pool.engine.stats()
    assert stats.preemptions > before  # the pool (10 blocks) cannot hold 4 x ~3 blocks at once
    assert stats.kv_blocks_used == 0 and stats.running == 0 and stats.waiting == 0


def test_request_larger_than_the_pool_is_refused_at_admission(tiny_pool: ServedModel) -> None:
    from inferd.engine.async_engine import AdmissionError

    with pytest.raises(AdmissionError, match="whole pool holds 160"):
        tiny_pool.engine.check_admission(100, SamplingParams(max_tokens=100))
