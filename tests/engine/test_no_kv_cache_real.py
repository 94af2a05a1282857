"""``no_kv_cache`` on the real default model: recomputing every token's whole sequence gives
the cached path's greedy text, alone and in a batch: in float32, and in the default dtype under
``deterministic`` (without it the cached path's decodes run the packed int4 kernels where a
recompute runs the prompt's dense ones, as after a preemption: README, Determinism)."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd import LLM
from inferd.engine.sampling import SamplingParams

CHATS = [
    [{"role": "user", "content": "Name three rivers in Europe."}],
    [{"role": "user", "content": "Write one sentence about a lighthouse."}],
    [{"role": "user", "content": "What is two plus two? Explain."}],
]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _texts(llm: LLM, chats: list[list[dict[str, str]]]) -> list[str]:
    return [out.outputs[0].text for out in llm.chat(chats, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize(("dtype", "deterministic"), [("f32", False), ("auto", True)])
def test_recomputing_every_token_gives_the_cached_greedy_text(
    smollm2_gguf: Path, dtype: str, deterministic: bool
) -> None:
    mode = {"dtype": dtype, "deterministic": deterministic}
    with (
        LLM(str(smollm2_gguf), no_kv_cache=True, **mode) as bare,
        LLM(str(smollm2_gguf), **mode) as cached,
    ):
        together = _texts(bare, CHATS)  # three requests recomputed side by side
        assert together == _texts(cached, CHATS)
        assert [_texts(bare, [chat])[0] for chat in CHATS] == together
        stats = bare.engine.stats()
        assert stats.prefix_cache_queries == 0 and stats.speculative_drafted == 0
        assert stats.kv_blocks_used == 0 and stats.prefix_cache_entries == 0
