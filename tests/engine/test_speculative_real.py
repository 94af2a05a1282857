"""Prompt-lookup speculation on the real default model: the same greedy text as without it.

Default mode: the same tokens on a copy-heavy prompt and on free generation, and the same stop
and length behaviour. ``deterministic=True``: the same bits (tokens and logprobs) with and
without speculation, for each request alone and in a mixed batch (speculating requests beside a
long prefill, a free-text request and a seeded sampled one), and every KV block back after.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from inferd import LLM
from inferd.engine.sampling import SamplingParams
from tests.engine.bits import run_bits

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs at dusk, lit the great lamp and wrote in "
    "his log the wind, the rain, the colour of the sea, and the names of the ships that passed "
    "the headland before the tide turned."
)
COPY = [{"role": "user", "content": f"Repeat this text twice, word for word:\n\n{PASSAGE}"}]
FREE = [{"role": "user", "content": "Tell me a story about a violin maker."}]
LONG = [
    {
        "role": "user",
        "content": "Ships passing along the coast counted the lighthouse's flashes. " * 12
        + "Summarize.",
    }
]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=1, ignore_eos=True)


def test_greedy_text_is_unchanged_by_speculation(pair: tuple[LLM, LLM]) -> None:
    on, off = pair
    copy = on.model.chat_prompt(COPY).ids
    prompts = [copy, on.model.chat_prompt(FREE).ids, copy]
    # The third: a repetition penalty, applied per verified position (drafts before it count).
    penalized = replace(_greedy(48), repetition_penalty=1.15)
    params = [_greedy(96), _greedy(48), penalized]
    before = on.engine.stats()
    fast = [run_bits(on, [p], [s])[0] for p, s in zip(prompts, params, strict=True)]
    after = on.engine.stats()
    plain = [run_bits(off, [p], [s])[0] for p, s in zip(prompts, params, strict=True)]
    # The copy was drafted and mostly accepted, in fewer steps than tokens.
    accepted = after.speculative_accepted - before.speculative_accepted
    assert accepted > 30
    assert after.steps - before.steps < sum(p.max_tokens for p in params) - accepted + 6
    for got, want in zip(fast, plain, strict=True):
        assert got[0] == want[0]  # the same tokens
        assert got[2] == want[2]
        # Verify rows run the decode kernels of as many rows (bit-equal under --deterministic,
        # below); here the output head's one-row kernel may round differently.
        assert max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) < 0.05
    assert off.engine.stats().speculative_drafted == 0
    assert on.engine.stats().kv_blocks_used == 0


def test_stop_strings_and_max_tokens_cut_at_the_same_token(pair: tuple[LLM, LLM]) -> None:
    on, off = pair
    prompt = on.model.chat_prompt(COPY).ids

    def both(params: SamplingParams) -> tuple[Any, Any]:
        fast = on.generate([prompt], [params], use_tqdm=False)[0].outputs[0]
        plain = off.generate([prompt], [params], use_tqdm=False)[0].outputs[0]
        assert (fast.text, fast.token_ids) == (plain.text, plain.token_ids)
        return fast, plain

    # The greedy copy without a stop string reaches "the names" (in the passage), so a
    # stop on it must end the text just before it, drafted or not.
    free = off.generate([prompt], [_greedy(200)], use_tqdm=False)[0].outputs[0].text
    assert "the names" in free
    stop = SamplingParams(max_tokens=200, temperature=0, stop=("the names",), ignore_eos=True)
    fast, plain = both(stop)
    assert fast.finish_reason == plain.finish_reason == "stop"
    assert fast.text == free[: free.index("the names")]
    fast, plain = both(_greedy(37))  # 37: not a whole number of verify steps
    assert fast.finish_reason == plain.finish_reason == "length"
    assert len(fast.token_ids) == 37


def test_deterministic_bits_alone_and_in_a_mixed_batch(smollm2_gguf: Path) -> None:
    greedy_copy, greedy_free, greedy_long = _greedy(64), _greedy(24), _greedy(8)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=99, logprobs=1, ignore_eos=True)
    options: dict[str, Any] = {"deterministic": True, "max_num_batched_tokens": 64}
    with LLM(str(smollm2_gguf), speculative="off", **options) as off:
        prompts = [off.model.chat_prompt(m).ids for m in (COPY, FREE, LONG, FREE)]
        params = [greedy_copy, greedy_free, greedy_long, seeded]
        plain = [run_bits(off, [p], [s])[0] for p, s in zip(prompts, params, strict=True)]
    with LLM(str(smollm2_gguf), speculative="ngram", **options) as on:
        alone = [run_bits(on, [p], [s])[0] for p, s in zip(prompts, params, strict=True)]
        before = on.engine.stats()
        assert before.speculative_accepted > 20
        # The copy speculates while the long prompt is prefilled in 64-token chunks beside it.
        batch = run_bits(on, prompts, params)
        stats = on.engine.stats()
        assert stats.speculative_accepted > before.speculative_accepted
    assert alone == plain
    assert batch == plain
    assert stats.kv_blocks_used == 0
