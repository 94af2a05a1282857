"""Sliding windows in the paged KV cache: when every layer slides, blocks behind the window
are given back as requests advance, and admission counts only window + chunk per request."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from inferd.config import EngineConfig
from inferd.engine.kv_cache import NULL_BLOCK, KVCacheManager
from inferd.engine.sampling import SamplingParams
from inferd.serving.served import load_model
from tests.engine.helpers import make_request
from tests.models.tiny import SLIDING_WINDOW, save_tiny

BS = 4


def _advance(kv: KVCacheManager, request_len: int, step: int) -> list[list[int]]:
    """Run one request of ``request_len`` tokens through the manager, ``step`` at a time;
    the block list after each step."""
    r = make_request("a", request_len)
    history = []
    while r.num_computed_tokens < request_len:
        n = min(step, request_len - r.num_computed_tokens)
        assert kv.allocate_slots(r, n)
        r.num_computed_tokens += n
        kv.cache_full_blocks(r)
        history.append(list(r.block_ids))
    kv.free(r)
    return history


def test_blocks_behind_the_window_are_freed_and_the_rest_kept() -> None:
    window = 6
    kv = KVCacheManager(64, BS, window=window)
    history = _advance(kv, 40, 1)
    for computed, ids in enumerate(history, start=1):
        # The next token (position ``computed``) sees keys from computed - window + 1 on.
        first_visible = max(computed - window, 0)  # as seen before this step's allocation
        live = [i for i, b in enumerate(ids) if b != NULL_BLOCK]
        assert live == list(range(live[0], len(ids)))  # freed blocks are a prefix
        assert live[0] <= first_visible // BS  # nothing still visible was freed
        assert len(live) <= kv.tokens_held(40, 1) // BS
    assert history[-1].count(NULL_BLOCK) == (40 - 1 - window + 1) // BS
    assert kv.pool.num_free == 63  # everything back, the null block never released


def test_without_a_window_every_block_is_kept() -> None:
    kv = KVCacheManager(64, BS)
    history = _advance(kv, 40, 3)
    assert NULL_BLOCK not in history[-1] and len(history[-1]) == 10
    assert kv.tokens_held(40, 3) == 40 and kv.pool.num_free == 63


def test_tokens_held_is_the_window_plus_one_chunk() -> None:
    kv = KVCacheManager(64, BS, window=512)
    assert kv.tokens_held(100, 256) == 100  # shorter than the window: all of it
    assert kv.tokens_held(32_768, 256) == (-(-(511 + 256) // BS) + 1) * BS
    assert KVCacheManager(64, BS).tokens_held(32_768, 256) == 32_768


def test_freed_blocks_stay_in_the_prefix_cache_and_are_not_registered_twice() -> None:
    kv = KVCacheManager(64, BS, window=5)
    r = make_request("a", 24)
    assert kv.allocate_slots(r, 24)
    r.num_computed_tokens = 24
    kv.cache_full_blocks(r)
    assert kv.allocate_slots(r, 1)  # frees blocks 0..3 (positions < 20)
    assert r.block_ids[:4] == [NULL_BLOCK] * 4 and kv.pool.num_cached == 6
    kv.cache_full_blocks(r)  # the nulls are skipped, not registered as content
    assert kv.pool.lookup(kv._hashes(r, 1)[0]) is not None  # still findable once freed
    kv.free(r)
    assert kv.pool.num_free == 63


def test_a_bad_window_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one key"):
        KVCacheManager(8, BS, window=0)


def test_all_sliding_model_runs_past_a_pool_smaller_than_its_sequence(tmp_path: Path) -> None:
    """Mistral with a 6-token window in a 24-token pool: a 60-token sequence fits only because
    the blocks behind the window are freed; greedy output still equals transformers'."""
    hf = save_tiny("mistral", tmp_path / "mistral")
    config = EngineConfig(
        dtype="f32", block_size=BS, kv_cache_tokens=24, max_num_batched_tokens=8, max_num_seqs=2
    )
    served = load_model(tmp_path / "mistral", config, progress=False)
    try:
        assert served.engine.engine.model_config.uniform_window == SLIDING_WINDOW
        prompt = [(7 * i + 3) % 200 for i in range(50)]
        params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

        async def generate() -> list[int]:
            return [
                t async for out in served.engine.generate(prompt, params) for t in out.token_ids
            ]

        ours = asyncio.run(generate())
        assert served.engine.engine.kv_capacity_tokens == 24
    finally:
        served.shutdown()
    with torch.inference_mode():
        ref = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=10,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    assert ours == ref[0, len(prompt) :].tolist()
