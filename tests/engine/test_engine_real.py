"""The whole engine on the real default model: greedy parity, concurrency, seeds, stops, aborts."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

from inferd.engine.outputs import RequestOutput
from inferd.engine.sampling import SamplingParams
from inferd.serving.served import ServedModel
from tests.kernels.choice import OPS_NAMES, ops_named

STORY = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]


async def _generate(
    served: ServedModel, prompt: list[int], params: SamplingParams
) -> list[RequestOutput]:
    return [out async for out in served.engine.generate(prompt, params)]


def _text(outputs: list[RequestOutput]) -> str:
    return "".join(o.text for o in outputs)


def _tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


async def _wait_idle(served: ServedModel) -> None:
    deadline = time.monotonic() + 10
    while served.engine.stats().kv_blocks_used or served.engine.stats().running:
        assert time.monotonic() < deadline, served.engine.stats()
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("ops_name", OPS_NAMES)
def test_greedy_32_tokens_equal_transformers(
    served_f32: ServedModel, hf_smollm2: Any, ops_name: str
) -> None:
    prompt = served_f32.chat_prompt(STORY).ids
    decoder = served_f32.engine.engine.model
    chosen = decoder.ops
    assert chosen.description == "fused CPU kernels"  # what the engine picked for f32
    decoder.use_kernels(ops_named(ops_name))  # no request is running: the engine is idle
    try:
        outputs = asyncio.run(
            _generate(served_f32, prompt, SamplingParams(max_tokens=32, temperature=0))
        )
    finally:
        decoder.use_kernels(chosen)
    with torch.inference_mode():
        ref = hf_smollm2.generate(
            torch.tensor([prompt]),
            max_new_tokens=32,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )[0, len(prompt) :].tolist()
    assert _tokens(outputs) == ref
    assert len(ref) == 32 and outputs[-1].finish_reason == "length"
    assert outputs[-1].num_output_tokens == 32 and outputs[-1].num_prompt_tokens == len(prompt)


def test_eight_concurrent_requests_match_their_solo_runs(served_f32: ServedModel) -> None:
    questions = [f"Name {k} colors and say why you like them." for k in range(2, 10)]
    prompts = [served_f32.chat_prompt([{"role": "user", "content": q}]).ids for q in questions]
    params = SamplingParams(max_tokens=24, temperature=0)

    async def solo() -> list[str]:
        return [_text(await _generate(served_f32, p, params)) for p in prompts]

    async def together() -> list[str]:
        results = await asyncio.gather(*(_generate(served_f32, p, params) for p in prompts))
        return [_text(r) for r in results]

    alone = asyncio.run(solo())
    assert asyncio.run(together()) == alone
    assert len(set(alone)) > 1  # the prompts really differ


def test_seed_reproduces_sampled_text(served_f32: ServedModel) -> None:
    prompt = served_f32.chat_prompt(STORY).ids

    def run(seed: int) -> str:
        params = SamplingParams(
            max_tokens=24, temperature=1.0, top_p=0.95, top_k=50, min_p=0.01, seed=seed
        )
        return _text(asyncio.run(_generate(served_f32, prompt, params)))

    first = run(7)
    assert run(7) == first
    assert len({first, run(8), run(9)}) > 1


def test_stop_string_ends_generation_and_is_not_emitted(served_f32: ServedModel) -> None:
    prompt = served_f32.chat_prompt(STORY).ids
    greedy = _text(
        asyncio.run(_generate(served_f32, prompt, SamplingParams(max_tokens=40, temperature=0)))
    )
    words = greedy.split()
    stop = words[len(words) // 2]
    outputs = asyncio.run(
        _generate(served_f32, prompt, SamplingParams(max_tokens=40, temperature=0, stop=(stop,)))
    )
    text = _text(outputs)
    assert stop not in text
    assert greedy.startswith(text) and greedy[len(text) :].startswith(stop)
    assert outputs[-1].finish_reason == "stop" and outputs[-1].stop_reason == stop


def test_end_of_turn_token_stops_a_short_answer(served_f32: ServedModel) -> None:
    prompt = served_f32.chat_prompt([{"role": "user", "content": "Say hi."}]).ids
    outputs = asyncio.run(
        _generate(served_f32, prompt, SamplingParams(max_tokens=200, temperature=0))
    )
    assert outputs[-1].finish_reason == "stop"
    assert "<|im_end|>" not in _text(outputs)
    assert outputs[-1].stop_reason in served_f32.engine.codec.eos_token_ids


def test_abandoned_request_frees_its_blocks(served_f32: ServedModel) -> None:
    prompt = served_f32.chat_prompt(STORY).ids

    async def scenario() -> None:
        stream = served_f32.engine.generate(prompt, SamplingParams(max_tokens=500, temperature=0))
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.aclose()  # type: ignore[attr-defined]
        await _wait_idle(served_f32)

    asyncio.run(scenario())
    stats = served_f32.engine.stats()
    assert stats.kv_blocks_used == 0 and stats.running == 0 and stats.waiting == 0


def test_too_long_request_is_refused_before_it_runs(served_f32: ServedModel) -> None:
    from inferd.engine.async_engine import AdmissionError

    limit = served_f32.engine.max_model_len
    with pytest.raises(AdmissionError, match=str(limit)):
        served_f32.engine.check_admission(10, SamplingParams(max_tokens=limit))


def test_prefix_cache_hit_gives_the_same_greedy_text(served_f32: ServedModel) -> None:
    system = "You are a careful assistant. " * 12
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "List three fruits."},
    ]
    prompt = served_f32.chat_prompt(messages).ids
    params = SamplingParams(max_tokens=16, temperature=0)

    async def run(salt: str) -> str:
        outs = [o async for o in served_f32.engine.generate(prompt, params, cache_salt=salt)]
        return _text(outs)

    cold = asyncio.run(run("cold-tenant"))
    before = served_f32.engine.stats().prefix_cache_hits
    warm = asyncio.run(run("cold-tenant"))  # same salt: the prompt's full blocks are reused
    hits = served_f32.engine.stats().prefix_cache_hits - before
    assert hits >= len(prompt) - served_f32.engine_config.block_size
    assert warm == cold
    before = served_f32.engine.stats().prefix_cache_hits
    asyncio.run(run("other-tenant"))
    assert served_f32.engine.stats().prefix_cache_hits == before  # salts never share blocks
