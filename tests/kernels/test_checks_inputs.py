"""The fused kernels' input checks that tests/kernels/test_checks.py leaves out: every kernel
entry refuses other dtypes, caches of another dtype and tensors off the CPU with an error."""

from __future__ import annotations

import pytest
import torch

from inferd.kernels.fused import FusedOps
from inferd.kernels.ops import KernelOps, Rotation
from inferd.layers.rotary import RopeScaling, RotaryEmbedding, inverse_frequencies
from tests.kernels.choice import ops_named

HEADS, KV_HEADS, DIM, BS, BLOCKS = 4, 2, 16, 4, 6


@pytest.fixture(scope="module")
def fused() -> KernelOps:
    return ops_named("fused")


def _caches(dtype: torch.dtype = torch.float32, device: str = "cpu") -> list[torch.Tensor]:
    return [torch.zeros(BLOCKS, BS, KV_HEADS, DIM, dtype=dtype, device=device) for _ in range(2)]


def _decode(
    fused: KernelOps,
    q_dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> torch.Tensor:
    k_cache, v_cache = _caches(cache_dtype, device)
    q = torch.randn(1, HEADS, DIM).to(device=device, dtype=q_dtype)
    tables, lens = torch.tensor([[1, 2]], device=device), torch.tensor([5], device=device)
    return fused.decode_attention(q, k_cache, v_cache, tables, lens, 0.25, None, 0)


def _rope(
    fused: KernelOps,
    table_rows: int = 32,
    position: int = 0,
    cache_dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> torch.Tensor:
    rotary = RotaryEmbedding(DIM, 8, inverse_frequencies(DIM, 10000.0, RopeScaling()))
    rotary.cover(table_rows)
    unused = torch.empty(0)
    positions = torch.tensor([position], device=device)
    rotation = Rotation(unused, unused, positions, rotary.cos, rotary.signed_sin)
    qkv = torch.randn(1, (HEADS + 2 * KV_HEADS) * DIM, device=device)
    k_cache, v_cache = _caches(cache_dtype, device)
    slots = torch.tensor([0], device=device)
    return fused.rope_write_kv(qkv, rotation, slots, k_cache, v_cache, HEADS)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_decode_attention_refuses_other_dtypes(fused: KernelOps, dtype: torch.dtype) -> None:
    with pytest.raises(RuntimeError, match="q must be float32 or bfloat16"):
        _decode(fused, q_dtype=dtype, cache_dtype=dtype)


def test_caches_of_another_dtype_are_refused(fused: KernelOps) -> None:
    """The kernels take caches of the activations' dtype or int8 ones; the ops hand a float
    cache of another dtype (--kv-cache-dtype bf16 under a float32 model) to the plain ops,
    which cast, and never to the kernels."""
    assert isinstance(fused, FusedOps)
    k_cache, v_cache = _caches(torch.bfloat16)
    q = torch.randn(1, HEADS, DIM)
    tables, lens = torch.tensor([[1, 2]]), torch.tensor([5])
    message = "the caches must be int8 or have the dtype of the activations"
    with pytest.raises(RuntimeError, match=message):
        fused.compiled.decode_attention(q, k_cache, v_cache, tables, lens, 0.25, 0.0, 0)
    with pytest.raises(RuntimeError, match=message):
        fused.compiled.rope_write_kv(
            torch.randn(1, (HEADS + 2 * KV_HEADS) * DIM),
            torch.tensor([0]),
            torch.tensor([0]),
            torch.zeros(8, DIM),
            torch.zeros(8, DIM),
            k_cache,
            v_cache,
            HEADS,
        )
    out = _decode(fused, cache_dtype=torch.bfloat16)
    assert out.dtype == torch.float32 and bool(out.isfinite().all())


def test_int8_linear_refuses_float16_rows(fused: KernelOps) -> None:
    x = torch.ones(1, 8, dtype=torch.float16)
    weight = torch.ones(4, 8, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16"):
        fused.int8_linear(x, weight, torch.ones(4, dtype=torch.float16))


def test_rope_and_attention_refuse_tensors_off_the_cpu(fused: KernelOps) -> None:
    # The meta device stands for any device that is not the CPU (no data to read at all).
    with pytest.raises(RuntimeError, match="q must be a CPU tensor, not on meta"):
        _decode(fused, device="meta")
    with pytest.raises(RuntimeError, match="qkv must be a CPU tensor, not on meta"):
        _rope(fused, device="meta")


def test_a_grown_rotary_table_takes_the_positions_it_covers(fused: KernelOps) -> None:
    """What a context stretched by rope scaling needs: the table grown to cover it at startup,
    and the kernel's bound moving with it."""
    assert _rope(fused, table_rows=64, position=63).shape == (1, HEADS, DIM)
    with pytest.raises(RuntimeError, match=r"positions\[0\] = 64 is outside the rotary table"):
        _rope(fused, table_rows=64, position=64)


def test_cover_grows_the_tables_to_the_same_values() -> None:
    inv = inverse_frequencies(DIM, 10000.0, RopeScaling(kind="linear", factor=2.0))
    grown = RotaryEmbedding(DIM, 8, inv)
    grown.cover(40)
    fresh = RotaryEmbedding(DIM, 40, inv)
    assert grown.max_position == 40
    assert torch.equal(grown.cos, fresh.cos) and torch.equal(grown.signed_sin, fresh.signed_sin)
    grown.cover(16)  # never shrinks
    assert grown.max_position == 40
