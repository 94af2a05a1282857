"""A KV pool too small for the load: requests are preempted, recomputed, and still exact."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferd.config import EngineConfig
from inferd.engine.outputs import RequestOutput
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
        tiny_pool.chat_prompt([{"role": "user", "content": f"Describe the number {k}."}]).ids
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

    # The pool holds 160 tokens, so the served context is lowered to 160 at startup.
    assert tiny_pool.engine.max_model_len == 160 and tiny_pool.sizing is not None
    assert tiny_pool.sizing.lowered_from == 8192
    with pytest.raises(AdmissionError, match="maximum context length is 160 tokens"):
        tiny_pool.engine.check_admission(100, SamplingParams(max_tokens=100))
    with pytest.raises(AdmissionError, match="asks for 160 prompt tokens"):
        tiny_pool.engine.check_admission(160, SamplingParams(max_tokens=1))


def test_a_request_given_the_room_runs_to_the_end_of_the_context(tiny_pool: ServedModel) -> None:
    """What a server gives a request without max_tokens: the room the prompt leaves."""
    prompt = [1000 + i for i in range(150)]
    room = tiny_pool.engine.room(len(prompt))
    assert room == 10 and tiny_pool.engine.room(160) == 0 and tiny_pool.engine.room(170) == 0

    async def run() -> list[RequestOutput]:
        params = SamplingParams(max_tokens=room, temperature=0.0)
        return [o async for o in tiny_pool.engine.generate(prompt, params)]

    outputs = asyncio.run(run())
    assert sum(len(o.token_ids) for o in outputs) == room
    assert outputs[-1].finish_reason == "length"
