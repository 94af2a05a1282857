"""The Python API's default max_tokens: SamplingParams' default, within the room the prompt
leaves in the context and the KV pool (the server's rule for a request without max_tokens)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from inferd.api import Engine
from inferd.config import EngineConfig


def test_a_request_without_max_tokens_runs_to_the_end_of_a_small_context(
    smollm2_gguf: Path,
) -> None:
    cfg = EngineConfig(dtype="f32", max_num_seqs=2, kv_cache_tokens=64)  # context lowered to 64
    engine = Engine.from_spec("smollm2", engine_config=cfg)
    prompt = [1000 + i for i in range(60)]  # room for 4, not SamplingParams' 256

    async def main() -> list[tuple[int, str | None]]:
        return [
            (len(d.token_ids), d.finish_reason)
            async for d in engine.generate(prompt=prompt, temperature=0.0)
        ]

    try:
        deltas = asyncio.run(main())
    finally:
        engine.shutdown()
    assert sum(n for n, _ in deltas) == 4 and deltas[-1][1] == "length"
