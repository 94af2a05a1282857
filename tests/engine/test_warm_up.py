"""The warm-up request an engine runs when it is assembled (``LLMEngine.warm_up``): the first
forward pass's one-time costs are paid before the first user's request, and nothing of it shows
afterwards: no counters, no KV blocks held, nothing in the prefix cache."""

from __future__ import annotations

from pathlib import Path

from inferd import LLM
from inferd.engine.sampling import SamplingParams


def test_the_warm_up_leaves_no_trace(smollm2_gguf: Path) -> None:
    with LLM(str(smollm2_gguf)) as llm:
        engine = llm.engine
        stats = engine.stats()
        assert (stats.steps, stats.prompt_tokens, stats.generated_tokens) == (0, 0, 0)
        assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)
        assert stats.kv_blocks_used == 0 and stats.running == stats.waiting == 0
        assert engine._core.scheduler.kv.pool.num_cached == 0
        # The counters count from here as on an engine that never ran.
        prompt = llm.model.chat_prompt([{"role": "user", "content": "Hello."}]).ids
        out = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
        after = engine.stats()
        assert after.prompt_tokens == len(prompt)
        assert after.generated_tokens == len(out[0].outputs[0].token_ids)
        assert after.prefix_cache_queries == len(prompt)
