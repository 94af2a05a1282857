"""The context and KV-pool sizing (serving/sizing.py) on the configs of real models: the
decisions are arithmetic on a model's shape and the RAM left after its weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from inferd.config import DEFAULT_KV_CACHE_MB, KV_RAM_FRACTION, EngineConfig
from inferd.models.config import config_from_hf
from inferd.serving.sizing import GIB, MIB, KVShape, SizingError, decide, kv_shape
from tests.serving.configs import (
    FOUR,
    GEMMA_2_9B,
    LLAMA_3_1_8B,
    LLAMA_3_8B,
    MISTRAL_7B,
    QWEN2_5_7B,
    dense_weight_bytes,
)

BF16 = 2
# transformers' convention for linear scaling: max_position_embeddings stays the original.
LINEAR_X2 = {
    **LLAMA_3_8B,
    "max_position_embeddings": 4096,
    "rope_scaling": {"type": "linear", "factor": 2.0},
}


def shape(hf: dict[str, Any], dtype_bytes: int = BF16) -> KVShape:
    return kv_shape(config_from_hf(hf), dtype_bytes)


@pytest.mark.parametrize(
    ("hf", "per_token"),
    [
        (LLAMA_3_8B, 2 * 32 * 8 * 128 * 2),  # 128 KiB
        (MISTRAL_7B, 2 * 32 * 8 * 128 * 2),
        (QWEN2_5_7B, 2 * 28 * 4 * 128 * 2),  # 56 KiB
        (GEMMA_2_9B, 2 * 42 * 8 * 256 * 2),  # 336 KiB: head_dim 256, not hidden / heads
    ],
)
def test_kv_bytes_per_token_from_the_config(hf: dict[str, Any], per_token: int) -> None:
    assert shape(hf).bytes_per_token == per_token
    assert shape(hf, 4).bytes_per_token == 2 * per_token


def test_the_issue_case_now_fits_one_full_context() -> None:
    """Llama-3-8B in bf16 with RAM to spare: the old default (512 MiB) held 4,096 tokens, half
    the 8,192-token context a request without max_tokens asks for."""
    s = decide(shape(LLAMA_3_8B), available_bytes=8 * GIB)
    assert (s.max_seq_len, s.pool_tokens, s.lowered_from) == (8192, 8192, None)
    assert s.pool_bytes == GIB
    assert "context 8192" in s.reason and "one full context" in s.reason


def test_too_little_ram_lowers_the_context_and_says_so() -> None:
    s = decide(shape(LLAMA_3_8B), available_bytes=1 * GIB)  # half of it: 512 MiB
    assert (s.max_seq_len, s.pool_tokens, s.lowered_from) == (4096, 4096, 8192)
    assert "context 4096, lowered from 8192" in s.reason
    assert "1.0 GiB of RAM free after the weights" in s.reason


def test_gemma_2_lowered_to_whole_blocks() -> None:
    # Half of 4 GiB over 336 KiB a token is 6241.5 tokens: 390 blocks of 16.
    s = decide(shape(GEMMA_2_9B), available_bytes=4 * GIB)
    assert (s.max_seq_len, s.pool_tokens, s.lowered_from) == (6240, 6240, 8192)


def test_a_small_context_gets_the_default_pool_beyond_it() -> None:
    # Qwen2.5-7B's 8,192-token context is 448 MiB of KV: the pool is the 512 MiB default.
    s = decide(shape(QWEN2_5_7B), available_bytes=8 * GIB)
    assert s.max_seq_len == 8192
    assert s.pool_tokens == DEFAULT_KV_CACHE_MB * MIB // (2 * 28 * 4 * 128 * 2) // 16 * 16 == 9360


def test_max_seq_len_grows_the_default_pool_within_the_ram() -> None:
    s = decide(shape(MISTRAL_7B), available_bytes=16 * GIB, max_seq_len=32768)
    assert (s.max_seq_len, s.pool_tokens, s.pool_bytes) == (32768, 32768, 4 * GIB)
    with pytest.raises(
        SizingError,
        match=r"--max-seq-len 32768 needs 32768 tokens of KV cache "
        r"\(4\.0 GiB\), but the pool holds 16384",
    ):
        decide(shape(MISTRAL_7B), available_bytes=4 * GIB, max_seq_len=32768)


@pytest.mark.parametrize(
    ("hf", "asked", "limit", "scaling"),
    [
        (LLAMA_3_8B, 8193, 8192, None),
        (GEMMA_2_9B, 16384, 8192, None),
        (LLAMA_3_1_8B, 131073, 131072, "llama3 x8"),
        (LINEAR_X2, 8193, 8192, "linear x2"),
    ],
)
def test_max_seq_len_past_the_positions_is_refused_with_the_limit(
    hf: dict[str, Any], asked: int, limit: int, scaling: str | None
) -> None:
    kv = shape(hf)
    assert kv.position_limit == limit
    refused = rf"--max-seq-len {asked} .* give at most {limit}"
    with pytest.raises(SizingError, match=refused) as info:
        decide(kv, available_bytes=64 * GIB, max_seq_len=asked)
    assert (scaling in str(info.value)) if scaling else "rope scaling" not in str(info.value)
    assert decide(kv, available_bytes=256 * GIB, max_seq_len=limit).max_seq_len == limit


def test_an_explicit_pool_lowers_the_default_context() -> None:
    s = decide(shape(LLAMA_3_8B), available_bytes=64 * GIB, kv_cache_tokens=2010)
    assert (s.max_seq_len, s.pool_tokens, s.lowered_from) == (2000, 2000, 8192)
    assert "set by --kv-cache-tokens" in s.reason
    s = decide(shape(LLAMA_3_8B), available_bytes=64 * GIB, kv_cache_mb=256)
    assert (s.max_seq_len, s.pool_tokens) == (2048, 2048)
    with pytest.raises(SizingError, match=r"--max-seq-len 4096 needs 4096 tokens .* holds 2048"):
        decide(shape(LLAMA_3_8B), available_bytes=64 * GIB, kv_cache_mb=256, max_seq_len=4096)


def test_no_ram_for_a_useful_context_is_refused() -> None:
    with pytest.raises(SizingError, match="fewer than 256; free memory, or set --kv-cache-mb"):
        decide(shape(GEMMA_2_9B), available_bytes=100 * MIB)


def sized_on(name: str, ram_gib: int) -> str:
    """One row of the decision table: a machine of ``ram_gib`` with the dense bf16 weights in."""
    hf = FOUR[name]
    free = max(0, ram_gib * GIB - dense_weight_bytes(hf))
    try:
        s = decide(shape(hf), available_bytes=free)
    except SizingError:
        return "refused"
    return f"context {s.max_seq_len}, pool {s.pool_tokens}"


@pytest.mark.parametrize("name", sorted(FOUR))
@pytest.mark.parametrize("ram_gib", [8, 16, 64])
def test_the_decision_on_a_machine(name: str, ram_gib: int) -> None:
    """Whatever the RAM, the pool stays within its share of what the weights leave, holds the
    served context, and holds a full 8,192-token context whenever that share allows."""
    hf = FOUR[name]
    kv = shape(hf)
    free = max(0, ram_gib * GIB - dense_weight_bytes(hf))
    share = int(free * KV_RAM_FRACTION)
    full = 8192 * kv.bytes_per_token
    try:
        s = decide(kv, available_bytes=free)
    except SizingError:
        assert share < 256 * kv.bytes_per_token  # refused only when no useful context fits
        return
    assert s.pool_bytes <= share and s.pool_tokens >= s.max_seq_len
    assert s.max_seq_len == 8192 if share >= full else s.lowered_from == 8192
    assert s.pool_bytes >= min(full, share - 16 * kv.bytes_per_token)


def test_decision_table_at_16_and_64_gib() -> None:
    """Dense bf16 weights: 8B-class models barely fit in 16 GiB, and Gemma-2-9B does not."""
    table = {(n, r): sized_on(n, r) for n in FOUR for r in (16, 64)}
    assert table[("Llama-3-8B", 16)] == "context 4256, pool 4256"  # 1.04 GiB left
    assert table[("Mistral-7B-v0.1", 16)] == "context 8192, pool 8192"
    assert table[("Gemma-2-9B", 16)] == "refused"
    for name in FOUR:
        assert table[(name, 64)].startswith("context 8192")


def test_a_model_whose_every_layer_slides_needs_only_its_window() -> None:
    """A full context holds at most window + chunk tokens at once (the rest is freed behind
    the window), so a pool smaller than the context still serves the whole context."""
    kv = shape(LLAMA_3_8B)
    s = decide(kv, available_bytes=64 * GIB, kv_cache_tokens=1024, window=512, chunk=256)
    assert (s.max_seq_len, s.pool_tokens, s.lowered_from) == (8192, 1024, None)
    lowered = decide(kv, available_bytes=64 * GIB, kv_cache_tokens=512, window=512, chunk=256)
    assert lowered.lowered_from == 8192 and lowered.max_seq_len == 512


def test_a_draft_models_weights_shrink_the_default_pool() -> None:
    """The draft model's weights leave that much less RAM free: a pool that RAM bounds shrinks
    by the KV fraction of the draft's bytes (the same share the served weights cost it)."""
    llama = shape(LLAMA_3_8B)
    available, draft = 600 * MIB, 120 * MIB  # RAM-bound: 50% of 600 MiB < the 512 MiB default
    alone = decide(llama, available_bytes=available)
    drafted = decide(llama, available_bytes=available, draft_bytes=draft)
    assert drafted.pool_tokens < alone.pool_tokens
    shrunk = alone.pool_bytes - drafted.pool_bytes
    block = 16 * llama.bytes_per_token
    assert abs(shrunk - draft * KV_RAM_FRACTION) < block
    assert "the draft model's 120 MiB included" in drafted.reason
    assert "draft" not in alone.reason
    # An explicit pool is what was asked for, draft or not.
    assert decide(llama, available_bytes=available, draft_bytes=draft, kv_cache_mb=64) == decide(
        llama, available_bytes=available, kv_cache_mb=64
    )


def test_served_models_sizing_counts_its_draft_model(tmp_path: Path) -> None:
    """--draft-model: the startup sizing line names the draft's bytes, which are its weights'."""
    from inferd.config import EngineConfig
    from inferd.serving.served import load_model
    from tests.models.tiny import save_tiny

    save_tiny("llama", tmp_path / "base")
    save_tiny("llama", tmp_path / "draft", seed=1, num_hidden_layers=1)
    cfg = EngineConfig(dtype="f32", speculative="draft", draft_model=str(tmp_path / "draft"))
    served = load_model(tmp_path / "base", cfg, progress=False)
    try:
        speculator = served.engine.engine._core.scheduler.speculator
        assert speculator is not None and speculator.drafter is not None
        draft = speculator.drafter.model
        assert draft is not served.engine.engine.model
        tensors = [*draft.parameters(), *draft.buffers()]
        draft_bytes = sum(t.numel() * t.element_size() for t in tensors)
        assert draft_bytes > 0
        assert served.sizing is not None
        kib = f"{draft_bytes / 1024:.0f} KiB"
        assert f"the draft model's {kib} included" in served.sizing.reason
    finally:
        served.shutdown()


# SmolLM2-135M's attention shape: 30 layers, 3 KV heads of 64 (the smallest head inferd serves).
SMOLLM2_135M = {
    **LLAMA_3_8B,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "num_hidden_layers": 30,
}


@pytest.mark.parametrize("hf", [SMOLLM2_135M, LLAMA_3_8B, QWEN2_5_7B, GEMMA_2_9B])
def test_an_int8_pool_holds_nearly_twice_the_tokens_of_bf16(hf: dict[str, Any]) -> None:
    """The same --kv-cache-mb (and the same default budget): an int8 pool holds >= 1.9x the
    tokens of a bf16 one; a float16 scale per 64-value row leaves it 1.94x at worst."""
    config = config_from_hf(hf)
    bf16 = kv_shape(config, BF16, cache_dtype="bf16")
    int8 = kv_shape(config, 1, cache_dtype="int8")
    head = config.head_dim
    assert int8.bytes_per_token == 2 * config.num_layers * config.num_kv_heads * (head + 2)
    for budget in ({"kv_cache_mb": 64}, {"kv_cache_mb": 1000}, {}):
        small = decide(bf16, available_bytes=2 * GIB, max_seq_len=128, **budget)
        large = decide(int8, available_bytes=2 * GIB, max_seq_len=128, **budget)
        assert large.pool_tokens >= 1.9 * small.pool_tokens, (budget, small, large)
        if budget:
            assert large.pool_bytes <= budget["kv_cache_mb"] * MIB
    s = decide(int8, available_bytes=8 * GIB, kv_cache_mb=64)
    assert f"KV cache {s.pool_tokens} tokens of int8, " in s.reason  # the startup line


def test_a_memory_fraction_gives_the_pool_that_share_of_the_free_ram() -> None:
    """--kv-memory-fraction F: the pool takes F of the RAM free after the weights whatever the
    context needs (the default stops at one full context); F is checked with the other sizes."""
    llama = shape(LLAMA_3_8B)  # 128 KiB a token in bf16
    default = decide(llama, available_bytes=8 * GIB)
    quarter = decide(llama, available_bytes=8 * GIB, memory_fraction=0.25)
    half = decide(llama, available_bytes=8 * GIB, memory_fraction=0.5)
    assert default.pool_tokens == 8192 and default.pool_bytes == GIB
    assert (quarter.pool_bytes, half.pool_bytes) == (2 * GIB, 4 * GIB)
    assert quarter.max_seq_len == half.max_seq_len == 8192
    assert "25% of the 8.0 GiB" in quarter.reason and "--kv-memory-fraction" in quarter.reason
    with pytest.raises(ValueError, match="one of kv_cache_tokens"):
        EngineConfig(kv_cache_mb=64, kv_memory_fraction=0.3)
    for bad in (0.0, 0.99, -1.0):
        with pytest.raises(ValueError, match="kv_memory_fraction"):
            EngineConfig(kv_memory_fraction=bad)
