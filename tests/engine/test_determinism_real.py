"""Determinism on the real default model in the default dtype (bf16 where the CPU has it).

Default mode: a greedy request's output does not depend on prefix-cache hits or on how its
prompt was chunked. ``deterministic=True``: a seeded request sampled at temperature 1 gives the
same bits whatever runs beside it (batch, chunking, preemption, prefix hits) and after a
restart. Outputs are compared by token ids and by their logprobs, exactly.
"""

from __future__ import annotations

from pathlib import Path

from inferd import LLM
from inferd.engine.sampling import SamplingParams
from tests.engine.bits import run_bits

# ~180 tokens: three 64-position attention tiles, so chunk boundaries fall inside tiles.
LONG_STORY = [
    {
        "role": "user",
        "content": "A lighthouse keeper logs the weather every hour: wind, rain, the colour of "
        "the sea, the ships that pass, the gulls on the rail. "
        * 5
        + "Write the next entry of the log, in his voice.",
    }
]
SHORT = [{"role": "user", "content": "Tell me a story about a violin maker."}]


def test_default_greedy_ignores_prefix_hits_and_chunking(smollm2_gguf: Path) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0, logprobs=1, ignore_eos=True)
    with LLM(str(smollm2_gguf), max_num_batched_tokens=512) as whole:
        prompt = whole.model.chat_prompt(LONG_STORY).ids
        assert 128 < len(prompt) <= 512  # one chunk here, several tiles
        first = run_bits(whole, [prompt], [greedy])[0]
        hits_before = whole.engine.stats().prefix_cache_hits
        retry = run_bits(whole, [prompt], [greedy])[0]  # the prefix cache holds all but the tail
        assert whole.engine.stats().prefix_cache_hits > hits_before
    assert retry == first
    # 24-token chunks: boundaries inside attention tiles, steps of more and fewer than 8 rows.
    with LLM(str(smollm2_gguf), max_num_batched_tokens=24) as chunked:
        assert run_bits(chunked, [prompt], [greedy])[0] == first
        assert run_bits(chunked, [prompt], [greedy])[0] == first  # and its retry


def test_deterministic_seeded_batch_equals_solo_and_restart(smollm2_gguf: Path) -> None:
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, logprobs=1, ignore_eos=True)
    other = SamplingParams(max_tokens=4, temperature=0.7, seed=7, logprobs=1, ignore_eos=True)
    # A pool too small for everything at once: the copies share their prompt's blocks, but the
    # 16 new tokens cross into a block of their own and some are preempted and recomputed.
    options = {"deterministic": True, "max_num_batched_tokens": 96, "kv_cache_tokens": 320}
    with LLM(str(smollm2_gguf), **options) as llm:
        prompt, long_prompt = (
            llm.model.chat_prompt(SHORT).ids,
            llm.model.chat_prompt(LONG_STORY).ids,
        )
        solo = run_bits(llm, [prompt], [seeded])[0]
        # 16 copies beside a long prompt prefilled in chunks and another sampled request; the
        # copies hit the solo run's cached prefix.
        batch = run_bits(llm, [prompt] * 16 + [long_prompt], [seeded] * 16 + [other])
        stats = llm.engine.stats()
        assert stats.preemptions > 0
        assert stats.prefix_cache_hits > 0
    assert batch[:16] == [solo] * 16
    # A fresh engine (new weights, KV pool, generators), other batch sizes: the same bits.
    with LLM(str(smollm2_gguf), deterministic=True, max_num_batched_tokens=40) as restarted:
        again = run_bits(restarted, [long_prompt, prompt], [other, seeded])
    assert again[1] == solo
    assert again[0] == batch[16]
