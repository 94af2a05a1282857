"""The int8 KV cache (inferd/kernels/kv_quant.py) in the kernels: the fused RoPE + KV write
against the plain reference (the same bytes), the fused decode attention over int8 rows against
the plain ops over the same rows (float32 arithmetic both: a tight tolerance), and both against
attention over the unquantized keys and values (within what int8 rounding costs); over the head
sizes and grouped-query ratios of the models inferd serves, sequences of several lengths whose
keys cross block boundaries, and long ones the grouped kernel splits into chunks."""

from __future__ import annotations

import pytest
import torch

from inferd.kernels.fused import FusedOps
from inferd.kernels.kv_quant import (
    SCALE_BYTES,
    dequantize_rows,
    head_dim_of,
    quantize_rows,
    row_width,
)
from inferd.kernels.ops import KernelOps
from inferd.kernels.plain import PlainOps
from inferd.layers.rotary import RopeScaling, RotaryEmbedding, inverse_frequencies
from tests.kernels.choice import ops_named

DTYPES = [torch.float32, torch.bfloat16]
HEAD_DIMS = [64, 128, 256]
GQA_RATIOS = [1, 4, 8]
KV_HEADS, BS = 2, 4
PLAIN = PlainOps()


@pytest.fixture(scope="module")
def fused() -> KernelOps:
    return ops_named("fused")


def _tight(dtype: torch.dtype) -> dict[str, float]:
    """Fused vs plain over the same int8 rows: float32 sums in another order, then one rounding
    to the output dtype (bf16: one unit in the last place either way)."""
    return {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 8e-3, "rtol": 8e-3}


def test_quantize_rows_layout_and_error_bound() -> None:
    torch.manual_seed(0)
    x = torch.randn(7, 3, 64) * torch.tensor([0.01, 1.0, 300.0])[None, :, None]
    x[0, 0] = 0.0  # an all-zero row: scale 0, codes 0, no division by zero
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (7, 3, 64 + SCALE_BYTES)
    assert head_dim_of(rows) == 64 and row_width(64, torch.int8) == 66
    codes = rows[..., :64]
    assert int(codes.abs().max()) == 127  # each row's largest value takes the full range
    assert torch.equal(dequantize_rows(rows[0, 0], torch.float32), torch.zeros(64))
    scale = rows[..., 64:].contiguous().view(torch.float16).float()
    err = (dequantize_rows(rows, torch.float32) - x).abs()
    # Half a step of the row's own scale (plus the float16 rounding of the scale at absmax).
    assert bool((err <= scale * 0.5 + x.abs() * 2**-10 + 1e-12).all())


def _rotary(dim: int, max_position: int = 64) -> RotaryEmbedding:
    return RotaryEmbedding(dim, max_position, inverse_frequencies(dim, 10000.0, RopeScaling()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ratio", GQA_RATIOS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_int8_rope_write_is_the_plain_reference_byte_for_byte(
    fused: KernelOps, dtype: torch.dtype, ratio: int, head_dim: int
) -> None:
    _check_write(fused, dtype, ratio * KV_HEADS, head_dim, head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_write_under_partial_rotary(fused: KernelOps, dtype: torch.dtype) -> None:
    _check_write(fused, dtype, 8, 96, 32)


def _check_write(
    fused: KernelOps, dtype: torch.dtype, heads: int, head_dim: int, rotary_dim: int
) -> None:
    torch.manual_seed(1)
    n = 5
    qkv = (torch.randn(n, (heads + 2 * KV_HEADS) * head_dim) * 2).to(dtype)
    positions, slots = torch.tensor([0, 17, 63, 4, 5]), torch.tensor([9, 2, 31, 3, 4])
    rotation = _rotary(rotary_dim).at(positions, dtype)
    quant = [torch.zeros(8, BS, KV_HEADS, head_dim + SCALE_BYTES, dtype=torch.int8) for _ in "kvkv"]
    floats = [torch.zeros(8, BS, KV_HEADS, head_dim, dtype=dtype) for _ in "kvkv"]
    q = fused.rope_write_kv(qkv, rotation, slots, quant[0], quant[1], heads)
    q_float = fused.rope_write_kv(qkv, rotation, slots, floats[0], floats[1], heads)
    PLAIN.rope_write_kv(qkv, rotation, slots, quant[2], quant[3], heads)
    PLAIN.rope_write_kv(qkv, rotation, slots, floats[2], floats[3], heads)
    assert torch.equal(q, q_float)  # the cache's dtype changes nothing of the queries
    # The kernel's int8 rows are the reference quantization of the values its float write
    # stores, byte for byte: the same scale, the same rounding of every code.
    for rows, stored in zip(quant[:2], floats[:2], strict=True):
        assert torch.equal(rows, quantize_rows(stored))
    # Values are copied as they are: the same bytes as the plain ops'. Keys are rotated in
    # float32 by the kernel and in the model dtype by the plain ops: in float32 the same bytes,
    # in bf16 a rotated value may differ in its last bit (half a step of a code near the
    # absmax), and the row's absmax with it (its scale): codes then differ by a step or two.
    assert torch.equal(quant[1], quant[3])
    codes, ref_codes = quant[0][..., :head_dim].int(), quant[2][..., :head_dim].int()
    if dtype == torch.float32:
        assert torch.equal(quant[0], quant[2])
    assert int((codes - ref_codes).abs().max()) <= 2
    # Against the float cache the same write fills: each value within half a step of its row.
    for rows, exact in zip(quant[:2], floats[:2], strict=True):
        flat = rows.view(-1, KV_HEADS, rows.shape[-1])[slots]
        want = exact.view(-1, KV_HEADS, head_dim)[slots].float()
        scale = flat[..., head_dim:].contiguous().view(torch.float16).float()
        err = (dequantize_rows(flat, torch.float32) - want).abs()
        assert bool((err <= scale * 0.5 + want.abs() * 2**-10).all())
    written = quant[0].view(-1, KV_HEADS * (head_dim + SCALE_BYTES)).any(dim=1)
    assert written.nonzero().flatten().tolist() == sorted(slots.tolist())  # only the n slots


def _caches(
    blocks: int, block: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float caches (in the model dtype) and their int8 copies."""
    torch.manual_seed(seed)
    k = torch.randn(blocks, block, kv_heads, head_dim).to(dtype)
    v = torch.randn(blocks, block, kv_heads, head_dim).to(dtype)
    return k, v, quantize_rows(k), quantize_rows(v)


def _compare(
    fused: KernelOps,
    dtype: torch.dtype,
    q: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    softcap: float | None,
    window: int,
) -> None:
    k, v, k8, v8 = caches
    args = (tables, lens, scale, softcap, window)
    out = fused.decode_attention(q, k8, v8, *args)
    ref = PLAIN.decode_attention(q, k8, v8, *args)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out, ref, **_tight(dtype))
    # The unquantized cache in float32: int8 rounding of N(0, 1) keys and values (steps of
    # ~1/40) moves the outputs by about a hundredth, never by a tenth.
    exact = PLAIN.decode_attention(q.float(), k.float(), v.float(), *args)
    err = (out.float() - exact).abs()
    assert float(err.max()) < 0.1 and float(err.mean()) < 0.012, (err.max(), err.mean())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ratio", GQA_RATIOS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_int8_decode_attention(
    fused: KernelOps, dtype: torch.dtype, ratio: int, head_dim: int
) -> None:
    caches = _caches(12, BS, KV_HEADS, head_dim, dtype, seed=2)
    tables = torch.tensor([[3, 9, 0, 0], [1, 4, 7, 2], [11, 0, 0, 0], [5, 6, 8, 10]])
    lens = torch.tensor([7, 16, 3, 13])  # within, at and across block boundaries
    q = torch.randn(4, ratio * KV_HEADS, head_dim).to(dtype)
    _compare(fused, dtype, q, caches, tables, lens, head_dim**-0.5, None, 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("softcap", "window"), [(20.0, 0), (None, 5), (2.0, 3)])
def test_int8_decode_attention_softcap_and_window(
    fused: KernelOps, dtype: torch.dtype, softcap: float | None, window: int
) -> None:
    caches = _caches(12, BS, KV_HEADS, 64, dtype, seed=3)
    tables = torch.tensor([[3, 9, 0, 0], [1, 4, 7, 2], [11, 0, 0, 0]])
    q = torch.randn(3, 4 * KV_HEADS, 64).to(dtype)
    _compare(fused, dtype, q, caches, tables, torch.tensor([7, 16, 3]), 0.125, softcap, window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (32, 8), (8, 1)])
def test_int8_decode_attention_over_long_contexts(
    fused: KernelOps, dtype: torch.dtype, heads: int, kv_heads: int
) -> None:
    """Keys split into chunks of the grouped kernel, merged; beside a row too short to fill
    every chunk; and the per-query-head kernel (the benchmark's baseline) on the same rows."""
    blocks = 70
    caches = _caches(3 * blocks, 16, kv_heads, 64, dtype, seed=6)
    tables = torch.randperm(3 * blocks).view(3, blocks)
    lens = torch.tensor([1000, 3, 517])
    q = torch.randn(3, heads, 64).to(dtype)
    _compare(fused, dtype, q, caches, tables, lens, 0.125, None, 0)
    assert isinstance(fused, FusedOps)
    per_head = fused.compiled.decode_attention(
        q, caches[2], caches[3], tables, lens, 0.125, 0.0, 0, False
    )
    ref = PLAIN.decode_attention(q, caches[2], caches[3], tables, lens, 0.125, None, 0)
    torch.testing.assert_close(per_head, ref, **_tight(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_decode_row_bits_do_not_depend_on_the_batch(
    fused: KernelOps, dtype: torch.dtype
) -> None:
    """--deterministic with an int8 cache: a row alone and beside a longer one, the same bits."""
    blocks = 70
    _, _, k8, v8 = _caches(2 * blocks, 16, 3, 64, dtype, seed=7)
    tables = torch.randperm(2 * blocks).view(2, blocks)
    q = torch.randn(2, 9, 64).to(dtype)
    both = fused.decode_attention(q, k8, v8, tables, torch.tensor([300, 1100]), 0.125, None, 0)
    alone = fused.decode_attention(q[:1], k8, v8, tables[:1], torch.tensor([300]), 0.125, None, 0)
    assert torch.equal(both[:1], alone)


def test_the_kernels_refuse_int8_caches_of_the_wrong_width(fused: KernelOps) -> None:
    assert isinstance(fused, FusedOps)
    k8 = torch.zeros(4, BS, KV_HEADS, 64, dtype=torch.int8)  # no room for the scales
    q = torch.randn(1, 2, 64)
    with pytest.raises(RuntimeError, match="heads of 64 over a cache of heads of 62"):
        fused.compiled.decode_attention(
            q, k8, k8, torch.tensor([[1]]), torch.tensor([1]), 1.0, 0.0, 0
        )
    with pytest.raises(RuntimeError, match="int8 or have the dtype"):
        fused.compiled.decode_attention(
            q, k8.short(), k8.short(), torch.tensor([[1]]), torch.tensor([1]), 1.0, 0.0, 0
        )
