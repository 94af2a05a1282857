"""Prompt logprobs on the real default model, against transformers' float32 logits.

The engine under test (``served_f32``) prefills at most 512 tokens a step, so the long prompt
here is computed in two chunks; its logprobs must still equal one full forward pass of the
reference model.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from inferd.engine.outputs import RequestOutput, TokenLogprob
from inferd.engine.sampling import SamplingParams
from inferd.serving.served import ServedModel

TOLERANCE = 1e-3
TOP = 4
TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting each of "
    "the one hundred and twelve steps, listening to the wind and the gulls and the sea. "
)


def _long_prompt(served: ServedModel) -> list[int]:
    ids: list[int] = []
    while len(ids) <= 700:  # more than one 512-token prefill chunk
        ids += served.tokenizer.encode(TEXT)
    return ids[:700]


def _reference(hf_model: Any, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab]: row i holds the log-probabilities of the token after i."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


async def _run(
    served: ServedModel, jobs: list[tuple[list[int], SamplingParams]]
) -> list[list[RequestOutput]]:
    async def one(prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
        return [out async for out in served.engine.generate(prompt, params)]

    return list(await asyncio.gather(*(one(p, s) for p, s in jobs)))


def _check_against_reference(
    prompt: list[int], got: tuple[TokenLogprob | None, ...], ref: torch.Tensor, k: int
) -> None:
    assert len(got) == len(prompt)
    assert got[0] is None  # nothing predicts the first token
    for i in range(1, len(prompt)):
        entry = got[i]
        assert entry is not None and entry.token_id == prompt[i]
        expected = float(ref[i - 1, prompt[i]])
        assert abs(entry.logprob - expected) < TOLERANCE, (i, entry.logprob, expected)
        assert len(entry.top) == k
        best = ref[i - 1].topk(k).values.tolist()
        for (token, value), want in zip(entry.top, best, strict=True):
            assert abs(value - want) < TOLERANCE  # the k best values, in order
            assert abs(value - float(ref[i - 1, token])) < TOLERANCE  # and the right tokens


def test_prompt_logprobs_across_prefill_chunks_match_transformers(
    served_f32: ServedModel, hf_smollm2: Any
) -> None:
    prompt = _long_prompt(served_f32)
    assert served_f32.engine_config.max_num_batched_tokens < len(prompt)
    ref = _reference(hf_smollm2, prompt)
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=TOP, logprobs=1)
    plain = SamplingParams(max_tokens=6, temperature=0)
    short = served_f32.tokenizer.encode("Once upon a time")
    # The scorer shares its steps with an ordinary request that is decoding meanwhile.
    scored, other = asyncio.run(_run(served_f32, [(prompt, params), (short, plain)]))

    first = scored[0].prompt_logprobs
    assert first is not None
    _check_against_reference(prompt, first, ref, TOP)
    assert all(out.prompt_logprobs is None for out in scored[1:])  # the first output only
    assert all(out.prompt_logprobs is None for out in other)
    # The first generated token's logprob continues the same distribution.
    sampled = scored[0].logprobs
    assert sampled is not None
    assert abs(sampled[0].logprob - float(ref[-1, sampled[0].token_id])) < TOLERANCE


def test_prompt_logprobs_ignore_the_prefix_cache(served_f32: ServedModel) -> None:
    prompt = _long_prompt(served_f32)[:300]
    warm = SamplingParams(max_tokens=1, temperature=0)
    asyncio.run(_run(served_f32, [(prompt, warm)]))  # now the prompt's blocks are cached
    before = served_f32.engine.stats()
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    (first,), (second,) = asyncio.run(_run(served_f32, [(prompt, params), (prompt, params)]))
    after = served_f32.engine.stats()
    assert after.prefix_cache_queries == before.prefix_cache_queries  # never looked up
    assert first.prompt_logprobs is not None and second.prompt_logprobs is not None
    assert first.prompt_logprobs[0] is None
    assert all(lp is not None and lp.top == () for lp in first.prompt_logprobs[1:])
    values = [lp.logprob for lp in first.prompt_logprobs if lp is not None]
    again = [lp.logprob for lp in second.prompt_logprobs if lp is not None]
    assert len(values) == len(prompt) - 1
    assert max(abs(a - b) for a, b in zip(values, again, strict=True)) < TOLERANCE


def test_a_one_token_prompt_has_only_the_null_entry(served_f32: ServedModel) -> None:
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)
    (outputs,) = asyncio.run(_run(served_f32, [([42], params)]))
    assert outputs[0].prompt_logprobs == (None,)
