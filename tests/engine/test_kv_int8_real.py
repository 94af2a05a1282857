"""The int8 KV cache on the real default model: what blocks go through works on int8 blocks
(their scales are inside them), and the text stays the model's.

``deterministic=True`` with ``kv_cache_dtype="int8"``: a seeded request gives the same bits
alone and in a batch that preempts, recomputes and hits the prefix cache, and with speculation
(rejected drafts' blocks truncated) the same as without. Against the bf16 cache: the greedy
tokens of the int8 engine are the bf16 engine's top-1 at nearly every position when the bf16
engine scores the same text (teacher forcing, not a run-off of two free generations).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from inferd import LLM
from inferd.engine.sampling import SamplingParams
from tests.engine.bits import run_bits

STORY = [{"role": "user", "content": "Tell me a story about a violin maker."}]
PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs at dusk, lit the great lamp and wrote in "
    "his log the wind, the rain, the colour of the sea, and the names of the ships that passed."
)
COPY = [{"role": "user", "content": f"Repeat this text twice, word for word:\n\n{PASSAGE}"}]
LONG = [
    {
        "role": "user",
        "content": "A lighthouse keeper logs the weather every hour: wind, rain, the colour of "
        "the sea, the ships that pass, the gulls on the rail. "
        * 5
        + "Write the next entry of the log, in his voice.",
    }
]
INT8 = {"kv_cache_dtype": "int8"}


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, logprobs=1, ignore_eos=True)


# A pool too small for everything at once (as tests/engine/test_determinism_real.py): copies
# of a prompt share its int8 blocks, and some are preempted and recomputed.
OPTIONS: dict[str, Any] = {"deterministic": True, "max_num_batched_tokens": 96, **INT8}
SEEDED = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, logprobs=1, ignore_eos=True)
OTHER = SamplingParams(max_tokens=4, temperature=0.7, seed=7, logprobs=1, ignore_eos=True)


@pytest.fixture(scope="module")
def int8_engine(smollm2_gguf: Path) -> Iterator[LLM]:
    with LLM(str(smollm2_gguf), kv_cache_tokens=320, speculative="off", **OPTIONS) as llm:
        assert llm.model.kv_cache_dtype == "int8"
        yield llm


def test_deterministic_int8_bits_alone_and_in_a_preempting_batch(int8_engine: LLM) -> None:
    llm = int8_engine
    prompt, long_prompt = llm.model.chat_prompt(STORY).ids, llm.model.chat_prompt(LONG).ids
    solo = run_bits(llm, [prompt], [SEEDED])[0]
    before = llm.engine.stats()
    batch = run_bits(llm, [prompt] * 8 + [long_prompt], [SEEDED] * 8 + [OTHER])
    stats = llm.engine.stats()
    assert stats.preemptions > before.preemptions
    assert stats.prefix_cache_hits > before.prefix_cache_hits
    assert batch[:8] == [solo] * 8


def test_deterministic_int8_bits_with_speculation(smollm2_gguf: Path, int8_engine: LLM) -> None:
    """Drafts are written into int8 blocks and rejected ones truncated: the same bits as
    without speculation, alone and beside other requests."""
    prompts = [int8_engine.model.chat_prompt(m).ids for m in (COPY, STORY)]
    params = [_greedy(32), SEEDED]
    alone = [run_bits(int8_engine, [p], [s])[0] for p, s in zip(prompts, params, strict=True)]
    with LLM(str(smollm2_gguf), speculative="ngram", **OPTIONS) as spec:
        together = run_bits(spec, prompts, params)
        stats = spec.engine.stats()
    assert stats.speculative_accepted > 5
    assert stats.kv_blocks_used == 0
    assert together == alone


def test_int8_greedy_text_is_the_bf16_models_top_choice(
    smollm2_gguf: Path, int8_engine: LLM
) -> None:
    """Each token the int8-cache engine picks greedily, scored by the default-cache engine on
    the same text: its top-1 at >= 90% of the positions (a few near-ties may flip), and the
    chosen tokens' logprobs close."""
    prompts = [int8_engine.model.chat_prompt(m).ids for m in (STORY, LONG)]
    outs = int8_engine.generate(prompts, _greedy(32), use_tqdm=False)
    with LLM(str(smollm2_gguf), speculative="off") as ref:
        assert ref.model.kv_cache_dtype in ("bf16", "f32")
        seqs = [o.prompt_token_ids + list(o.outputs[0].token_ids) for o in outs]
        scored = ref.generate(seqs, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    same, drift = [], []
    for o, s in zip(outs, scored, strict=True):
        assert s.prompt_logprobs is not None and o.outputs[0].logprobs is not None
        expected = s.prompt_logprobs[len(o.prompt_token_ids) :]
        for got, want in zip(o.outputs[0].logprobs, expected, strict=True):
            assert want is not None
            same.append(want.top[0][0] == got.token_id)
            drift.append(abs(got.logprob - want.logprob))
    assert len(same) == 64
    assert sum(same) / len(same) >= 0.9, same
    assert sum(drift) / len(drift) < 0.1, drift
