"""The fused kernel ops against the plain PyTorch ops they replace, over the head sizes and
grouped-query ratios of the models inferd serves; and the choice between the two."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inferd import kernels
from inferd.kernels import FUSED_DTYPES, build_status, kernel_isa, load_ops
from inferd.kernels.fused import FusedOps
from inferd.kernels.ops import KernelOps
from inferd.kernels.plain import (
    PlainOps,
    gather_blocks,
    grouped_attention,
    unpack_int4_rows,
    unpack_vnni,
)
from inferd.layers.linear import (
    Linear,
    PackedKind,
    pack_int4_rows,
    pack_int4_vnni,
    pack_int8,
    pack_int8_vnni,
)
from inferd.layers.rotary import RopeScaling, RotaryEmbedding, inverse_frequencies
from tests.kernels.choice import ops_named

DTYPES = [torch.float32, torch.bfloat16]
HEAD_DIMS = [64, 128, 256]
GQA_RATIOS = [1, 4, 8]  # query heads per KV head
KV_HEADS, BS = 2, 4
PLAIN = PlainOps()


@pytest.fixture(scope="module")
def fused() -> KernelOps:
    return ops_named("fused")


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def test_the_kernels_build_here() -> None:
    # CI machines have a compiler: a build failure must show, not fall back silently.
    for dtype in FUSED_DTYPES:
        ops = load_ops(dtype)
        assert isinstance(ops, FusedOps), ops.description
        assert ops.description == "fused CPU kernels"


def test_float16_models_run_the_plain_ops_and_say_why() -> None:
    ops = load_ops(torch.float16)
    assert isinstance(ops, PlainOps) and not isinstance(ops, FusedOps)
    assert ops.description == (
        "plain PyTorch ops (the fused kernels take float32 and bfloat16, not torch.float16)"
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 2048])
def test_rms_norm(fused: KernelOps, dtype: torch.dtype, hidden: int) -> None:
    torch.manual_seed(0)
    weight = torch.randn(hidden).to(dtype)
    x = (torch.randn(5, hidden) * 3).to(dtype)
    torch.testing.assert_close(
        fused.rms_norm(x, weight, 1e-5), PLAIN.rms_norm(x, weight, 1e-5), **_tol(dtype)
    )
    # Per-head q/k norms see a strided view of the QKV rows.
    heads = x.view(5, -1, 32)[:, ::2]
    torch.testing.assert_close(
        fused.rms_norm(heads, weight[:32], 1e-5),
        PLAIN.rms_norm(heads, weight[:32], 1e-5),
        **_tol(dtype),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 640, 2048])
def test_gemma_rms_norm(fused: KernelOps, dtype: torch.dtype, hidden: int) -> None:
    # Gemma scales by 1 + w in float32 and rounds once, where Llama rounds before its weight.
    torch.manual_seed(hidden)
    weight = (torch.randn(hidden) * 0.5).to(dtype)
    x = (torch.randn(7, hidden) * 3).to(dtype)
    expected = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    expected = (expected * (1.0 + weight.float())).to(dtype)
    for ops in (fused, PLAIN):
        torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6, True), expected, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 16, 200])
@pytest.mark.parametrize("hidden", [64, 576, 2048])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_add_rms_norm_is_the_add_then_the_norm(
    fused: KernelOps, dtype: torch.dtype, rows: int, hidden: int, unit_offset: bool
) -> None:
    # The decoder runs it in place of ``x + delta`` and ``rms_norm`` (every residual add): the
    # same bits, or the greedy tokens change; on both the fused ops and the plain ones.
    torch.manual_seed(rows + hidden)
    weight = torch.randn(hidden).to(dtype)
    x = (torch.randn(rows, hidden) * 4).to(dtype)
    delta = (torch.randn(rows, hidden) * torch.logspace(-4, 2, hidden)).to(dtype)
    for ops in (fused, PLAIN):
        total, normed = ops.add_rms_norm(x, delta, weight, 1e-5, unit_offset)
        assert torch.equal(total, x + delta)
        assert torch.equal(normed, ops.rms_norm(x + delta, weight, 1e-5, unit_offset))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ratio", GQA_RATIOS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("unit_offset", [False, True])
def test_qk_rms_norm(
    fused: KernelOps, dtype: torch.dtype, ratio: int, head_dim: int, unit_offset: bool
) -> None:
    # Each q and k head normed with its own weight inside the fused QKV rows; v untouched.
    torch.manual_seed(ratio * head_dim)
    heads = ratio * KV_HEADS
    qkv = (torch.randn(5, (heads + 2 * KV_HEADS) * head_dim) * 3).to(dtype)
    q_w, k_w = (torch.randn(head_dim) * 0.5).to(dtype), (torch.randn(head_dim) * 0.5).to(dtype)
    got = fused.qk_rms_norm(qkv, q_w, k_w, heads, KV_HEADS, 1e-6, unit_offset)
    q_end, k_end = heads * head_dim, (heads + KV_HEADS) * head_dim
    q = PLAIN.rms_norm(qkv[:, :q_end].reshape(5, heads, head_dim), q_w, 1e-6, unit_offset)
    k = PLAIN.rms_norm(qkv[:, q_end:k_end].reshape(5, KV_HEADS, head_dim), k_w, 1e-6, unit_offset)
    torch.testing.assert_close(got[:, :q_end], q.flatten(1), **_tol(dtype))
    torch.testing.assert_close(got[:, q_end:k_end], k.flatten(1), **_tol(dtype))
    assert torch.equal(got[:, k_end:], qkv[:, k_end:])
    plain = PLAIN.qk_rms_norm(qkv, q_w, k_w, heads, KV_HEADS, 1e-6, unit_offset)
    torch.testing.assert_close(got, plain, **_tol(dtype))


def _rotary(dim: int, max_position: int = 64) -> RotaryEmbedding:
    return RotaryEmbedding(dim, max_position, inverse_frequencies(dim, 10000.0, RopeScaling()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ratio", GQA_RATIOS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_rope_and_kv_write(fused: KernelOps, dtype: torch.dtype, ratio: int, head_dim: int) -> None:
    _check_rope(fused, dtype, ratio * KV_HEADS, head_dim, rotary_dim=head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
def test_partial_rotary_passes_the_rest_of_each_head_through(
    fused: KernelOps, dtype: torch.dtype
) -> None:
    _check_rope(fused, dtype, 8, 96, rotary_dim=32)  # Phi-3's share of a head


def _check_rope(
    fused: KernelOps, dtype: torch.dtype, heads: int, head_dim: int, rotary_dim: int
) -> None:
    torch.manual_seed(1)
    n = 3
    qkv = torch.randn(n, (heads + 2 * KV_HEADS) * head_dim).to(dtype)
    positions, slots = torch.tensor([0, 17, 63]), torch.tensor([9, 2, 31])
    rotation = _rotary(rotary_dim).at(positions, dtype)
    caches = [torch.zeros(8, BS, KV_HEADS, head_dim, dtype=dtype) for _ in range(4)]
    q = fused.rope_write_kv(qkv, rotation, slots, caches[0], caches[1], heads)
    q_ref = PLAIN.rope_write_kv(qkv, rotation, slots, caches[2], caches[3], heads)
    torch.testing.assert_close(q, q_ref, **_tol(dtype))
    torch.testing.assert_close(caches[0], caches[2], **_tol(dtype))
    assert torch.equal(caches[1], caches[3])  # v is copied as is
    assert caches[0].count_nonzero() == n * KV_HEADS * head_dim  # only the three slots
    if rotary_dim < head_dim:  # the channels past the rotary share are q's, untouched
        q_in = qkv[:, : heads * head_dim].view(n, heads, head_dim)
        assert torch.equal(q[..., rotary_dim:], q_in[..., rotary_dim:])


def _decode_case(
    dtype: torch.dtype, heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(2)
    k_cache = torch.randn(12, BS, KV_HEADS, head_dim).to(dtype)
    v_cache = torch.randn(12, BS, KV_HEADS, head_dim).to(dtype)
    tables = torch.tensor([[3, 9, 0, 0], [1, 4, 7, 2], [11, 0, 0, 0]])  # scattered, padded
    lens = torch.tensor([7, 16, 3])
    q = torch.randn(3, heads, head_dim).to(dtype)
    return q, k_cache, v_cache, tables, lens


def _reference_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    softcap: float | None,
    window: int,
) -> torch.Tensor:
    """Keys before each length (and within the window), by gathered blocks and the grouped
    attention in float32."""
    keys = torch.arange(tables.shape[1] * BS)[None, :]
    mask = keys < lens[:, None]
    if window:
        mask &= keys >= lens[:, None] - window
    return grouped_attention(
        q.unsqueeze(2).float(),
        gather_blocks(k_cache, tables).float(),
        gather_blocks(v_cache, tables).float(),
        mask[:, None, None, :],
        0.3,
        softcap,
    ).squeeze(2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ratio", GQA_RATIOS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_decode_attention(fused: KernelOps, dtype: torch.dtype, ratio: int, head_dim: int) -> None:
    q, k_cache, v_cache, tables, lens = _decode_case(dtype, ratio * KV_HEADS, head_dim)
    expected = _reference_decode(q, k_cache, v_cache, tables, lens, None, 0)
    for ops in (fused, PLAIN):
        out = ops.decode_attention(q, k_cache, v_cache, tables, lens, 0.3, None, 0)
        torch.testing.assert_close(out.float(), expected, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("softcap", "window"), [(20.0, 0), (None, 5), (2.0, 3)])
def test_decode_attention_softcap_and_window(
    fused: KernelOps, dtype: torch.dtype, softcap: float | None, window: int
) -> None:
    q, k_cache, v_cache, tables, lens = _decode_case(dtype, 4 * KV_HEADS, 64)
    expected = _reference_decode(q, k_cache, v_cache, tables, lens, softcap, window)
    for ops in (fused, PLAIN):
        out = ops.decode_attention(q, k_cache, v_cache, tables, lens, 0.3, softcap, window)
        torch.testing.assert_close(out.float(), expected, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 1), (9, 3), (32, 8)])
@pytest.mark.parametrize(("softcap", "window"), [(None, 0), (30.0, 0), (None, 300)])
def test_decode_attention_over_long_contexts(
    fused: KernelOps,
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    softcap: float | None,
    window: int,
) -> None:
    """Long enough that the grouped kernel splits each KV head's keys into chunks and merges
    their softmax sums; beside it a sequence too short to fill every chunk."""
    torch.manual_seed(6)
    block, dim, lens = 16, 64, torch.tensor([1000, 3, 517])
    blocks = 70
    k_cache = torch.randn(3 * blocks, block, kv_heads, dim).to(dtype)
    v_cache = torch.randn(3 * blocks, block, kv_heads, dim).to(dtype)
    tables = torch.randperm(3 * blocks).view(3, blocks)  # scattered blocks
    q = torch.randn(3, heads, dim).to(dtype)
    expected = PLAIN.decode_attention(q, k_cache, v_cache, tables, lens, 0.125, softcap, window)
    out = fused.decode_attention(q, k_cache, v_cache, tables, lens, 0.125, softcap, window)
    torch.testing.assert_close(out.float(), expected.float(), **_tol(dtype))
    assert isinstance(fused, FusedOps)  # and the per-query-head kernel, the benchmark's baseline
    per_head = fused.compiled.decode_attention(
        q, k_cache, v_cache, tables, lens, 0.125, softcap or 0.0, window, False
    )
    torch.testing.assert_close(per_head.float(), expected.float(), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_decode_attention_with_peaked_scores(
    fused: KernelOps, dtype: torch.dtype, head_dim: int
) -> None:
    """Scores hundreds apart (most weights far below e^-87, the AVX-512 path's exp clamps them
    to ~0), keys in tiles of 16 cut by block edges and a ragged tail: the largest scores' values
    win, as in float64."""
    torch.manual_seed(9)
    block, kv_heads, heads, blocks = 16, 2, 6, 12
    k_cache = (torch.randn(2 * blocks, block, kv_heads, head_dim) * 4).to(dtype)
    v_cache = torch.randn(2 * blocks, block, kv_heads, head_dim).to(dtype)
    tables = torch.randperm(2 * blocks).view(2, blocks)
    q = (torch.randn(2, heads, head_dim) * 4).to(dtype)
    lens = torch.tensor([181, 37])
    out = fused.decode_attention(q, k_cache, v_cache, tables, lens, 1.0, None, 0)
    keys = gather_blocks(k_cache, tables).double()  # [batch, kv_heads, keys, dim]
    values = gather_blocks(v_cache, tables).double()
    group = heads // kv_heads
    for b, n in enumerate(lens.tolist()):
        kk = keys[b, :, :n].repeat_interleave(group, 0)  # [heads, n, dim]
        vv = values[b, :, :n].repeat_interleave(group, 0)
        scores = torch.einsum("hd,hnd->hn", q[b].double(), kk)
        want = torch.einsum("hn,hnd->hd", scores.softmax(-1), vv)
        assert float(scores.max(-1).values.sub(scores.median(-1).values).min()) > 87
        # float32 scores of ~|300| carry ~1e-5 of rounding into their weights' exponents
        tol = _tol(dtype) if dtype == torch.bfloat16 else {"atol": 5e-4, "rtol": 5e-4}
        torch.testing.assert_close(out[b].double(), want, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_row_bits_do_not_depend_on_the_batch(
    fused: KernelOps, dtype: torch.dtype
) -> None:
    """A row alone and beside a much longer row: the same bits (--deterministic relies on it;
    the grouped kernel once chose its key chunks by the batch's longest row)."""
    torch.manual_seed(7)
    block, kv_heads, dim, blocks = 16, 3, 64, 70
    k_cache = torch.randn(2 * blocks, block, kv_heads, dim).to(dtype)
    v_cache = torch.randn(2 * blocks, block, kv_heads, dim).to(dtype)
    tables = torch.randperm(2 * blocks).view(2, blocks)
    q = torch.randn(2, 9, dim).to(dtype)
    both = fused.decode_attention(
        q, k_cache, v_cache, tables, torch.tensor([300, 1100]), 0.125, None, 0
    )
    alone = fused.decode_attention(
        q[:1], k_cache, v_cache, tables[:1], torch.tensor([300]), 0.125, None, 0
    )
    assert torch.equal(both[:1], alone)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_activations(fused: KernelOps, dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    x = (torch.randn(4, 2 * 40) * 4).to(dtype)
    torch.testing.assert_close(fused.silu_mul(x), PLAIN.silu_mul(x), **_tol(dtype))
    torch.testing.assert_close(fused.gelu_tanh_mul(x), PLAIN.gelu_tanh_mul(x), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("in_features", [96, 104])  # 104: a tail past the 16-wide steps
def test_int8_linear(
    fused: KernelOps,
    dtype: torch.dtype,
    rows: int,
    in_features: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The int8 weight-only kernel (ISQ q8, float32 models, builds without VNNI)."""
    monkeypatch.setenv(kernels.INT4_INT8_ENV, "0")  # bf16 weights: not the int8 x int8 kernel
    torch.manual_seed(4)
    layer = Linear(in_features, 80).to(dtype)
    layer.pack(PackedKind.INT8, source=torch.randn(80, in_features))
    assert layer.packed_kind is PackedKind.INT8
    x = torch.randn(rows, in_features).to(dtype)
    assert layer._packed is not None and layer._scales is not None
    weight = layer._packed.float() * layer._scales.float()[:, None]
    # The weight it encodes, not torch's kernel: that one reads past rows of 104 in bf16 (its
    # output changes from run to run there), so the fused ops never hand it such rows.
    expected = (x.float() @ weight.T).to(dtype)
    layer.ops = fused
    torch.testing.assert_close(layer(x), expected, **_tol(dtype))
    if in_features % 32 == 0:  # and torch's kernel where it is sound
        torch.testing.assert_close(layer(x), PLAIN.int8_linear(x, layer._packed, layer._scales))


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("in_features", [24, 104])
def test_plain_int8_linear_takes_rows_of_any_length(rows: int, in_features: int) -> None:
    """The reference op on rows that are no whole blocks of 32 (a mixture of experts' down
    projection, 24 wide): torch's kernel alone reads past them (garbage, or a crash)."""
    torch.manual_seed(7)
    w, scale = pack_int8(torch.randn(48, in_features), torch.bfloat16)
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    expected = (x.float() @ (w.float() * scale.float()[:, None]).T).to(torch.bfloat16)
    torch.testing.assert_close(PLAIN.int8_linear(x, w, scale), expected, **_tol(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_linear_rows_do_not_depend_on_their_neighbours(
    fused: KernelOps, dtype: torch.dtype
) -> None:
    """Each row has the bits it has alone, in every tile position (the AVX-512 kernel takes 8
    rows a pass) and batch size up to 17, and the product of the weight it encodes."""
    torch.manual_seed(6)
    w, scale = pack_int8(torch.randn(48, 104), dtype)
    x = torch.randn(17, 104).to(dtype)
    alone = torch.cat([fused.int8_linear(x[i : i + 1], w, scale) for i in range(17)])
    expected = (x.float() @ (w.float() * scale.float()[:, None]).T).to(dtype)
    torch.testing.assert_close(alone, expected, **_tol(dtype))
    for rows in (2, 7, 8, 9, 16, 17):
        assert torch.equal(fused.int8_linear(x[:rows], w, scale), alone[:rows])


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8])
@pytest.mark.parametrize("out_features", [80, 101])
def test_int4_rows_linear(fused: KernelOps, rows: int, out_features: int) -> None:
    """A float32 model's int4 copy: inferd's row layout, against the weight it encodes."""
    torch.manual_seed(5)
    w = torch.randn(out_features, 96)
    layer = Linear(96, out_features)
    layer.pack(PackedKind.INT4, source=w)
    assert layer.packed_kind is PackedKind.INT4_ROWS
    x = torch.randn(rows, 96)
    expected = x @ unpack_int4_rows(*int4_row_tensors(layer)).T
    assert (unpack_int4_rows(*int4_row_tensors(layer)) - w).abs().max() < 0.3  # int4 of N(0, 1)
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-4)  # plain ops
    layer.ops = fused
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-4)
    bf16 = x.bfloat16()  # bf16 activations are widened first
    torch.testing.assert_close(
        fused.int4_rows_linear(bf16, *int4_row_tensors(layer)).float(),
        bf16.float() @ unpack_int4_rows(*int4_row_tensors(layer)).T,
        **_tol(torch.bfloat16),
    )


def int4_row_tensors(layer: Linear) -> tuple[torch.Tensor, torch.Tensor]:
    assert layer._packed is not None and layer._scales is not None
    return layer._packed, layer._scales


def test_int4_rows_kernel_refuses_what_it_cannot_take(fused: KernelOps) -> None:
    packed, sm = pack_int4_rows(torch.randn(16, 64))
    with pytest.raises(RuntimeError, match="for rows of"):
        fused.int4_rows_linear(torch.randn(2, 96), packed, sm)
    with pytest.raises(RuntimeError, match="whole groups of 32"):
        fused.int4_rows_linear(torch.randn(2, 48), packed[:, :24].contiguous(), sm)
    with pytest.raises(RuntimeError, match="must be"):
        fused.int4_rows_linear(torch.randn(2, 64), packed, sm.bfloat16())


# The VNNI kernels by the bits of their weight codes: (pack, the op's name).
VNNI = {4: (pack_int4_vnni, "int4_vnni_linear"), 8: (pack_int8_vnni, "int8_vnni_linear")}


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 64])
@pytest.mark.parametrize(("out_features", "in_features"), [(16, 32), (101, 96), (80, 576)])
def test_vnni_linear(
    fused: KernelOps, bits: int, rows: int, out_features: int, in_features: int
) -> None:
    """int4/int8 x int8 against the plain reference, which quantizes the rows the same way: the
    same int8 codes (one code off in a group would move an output by ~1e-2), float sums that
    differ in order only; and against the dense product it approximates."""
    pack, op = VNNI[bits]
    torch.manual_seed(rows + out_features)
    w = torch.randn(out_features, in_features)
    packed, sm = pack(w)
    x = (torch.randn(rows, in_features) * 3).bfloat16().float()  # ties to round half-even
    x[-1, -32:] = 0.0  # a group of zeros: scale 0, no division by it
    ours = getattr(fused, op)(x, packed, sm, out_features)
    ref = getattr(PLAIN, op)(x, packed, sm, out_features)
    # Float32 sums of in_features / 32 pairs of terms (scale and min), each ~30 and cancelling
    # (int4 mins are ~ -range / 2): other orders move the last bits of ~600, a few 1e-5 each.
    torch.testing.assert_close(ours, ref, atol=3e-4, rtol=1e-5)
    codes, scale, lo = unpack_vnni(packed, sm, out_features)
    weight = (codes * scale[..., None] + lo[..., None]).view(out_features, -1)
    # The packed weight is the weight, to its codes' step (int4: (max - min) / 15 a group).
    assert (weight - w).abs().max() <= (0.25 if bits == 4 else 0.02) * w.abs().max()
    dense = x @ weight.T
    assert (ours - dense).abs().max() <= 0.02 * dense.abs().max() + 1e-6  # int8 rows: ~0.5% noise
    # bf16 rows: the same float sums, rounded to nearest even at the end.
    assert torch.equal(getattr(fused, op)(x.bfloat16(), packed, sm, out_features), ours.bfloat16())


def test_int8_vnni_pack_keeps_q8_0_weights_exact() -> None:
    """A weight that came from GGML Q8_0 blocks (codes -127..127 times an f16 scale per 32)
    packs to its own codes and scales: the int8 copy of a Q8_0 head loses nothing."""
    torch.manual_seed(5)
    codes = torch.randint(-127, 128, (48, 4, 32)).float()
    codes[:, :, 0] = 127  # each block reaches its absmax, as Q8_0's quantizer makes it
    d = (torch.rand(48, 4, 1) * 0.01).half().float()
    w = (codes * d).view(48, 128)
    unpacked, scale, lo = unpack_vnni(*pack_int8_vnni(w), 48)
    assert torch.equal(unpacked, codes) and torch.equal(scale, d[..., 0])
    assert not lo.any()


def test_int4_vnni_pack_keeps_q4_1_weights_exact() -> None:
    """A weight that came from GGML Q4_1 blocks (codes 0..15 times an f16 scale plus an f16
    min per 32, the codes reaching 0 and 15) packs to its own codes, scales and mins: the
    float16 scales lose nothing of a Q4_1 model."""
    torch.manual_seed(6)
    codes = torch.randint(0, 16, (48, 4, 32)).float()
    codes[:, :, 0], codes[:, :, 1] = 0, 15  # each block spans its range, as Q4_1's quantizer
    d = (torch.rand(48, 4, 1) * 0.01 + 1e-4).half().float()
    m = (-torch.rand(48, 4, 1) * 0.08).half().float()
    w = (codes * d + m).view(48, 128)
    packed, sm = pack_int4_vnni(w)
    assert sm.dtype == torch.float16
    unpacked, scale, lo = unpack_vnni(packed, sm, 48)
    assert torch.equal(unpacked, codes)
    assert torch.equal(scale, d[..., 0]) and torch.equal(lo, m[..., 0])


@pytest.mark.parametrize("bits", [4, 8])
def test_vnni_rows_do_not_depend_on_the_batch_or_the_threads(fused: KernelOps, bits: int) -> None:
    """A row's bits are its own: alone, in a batch of 16 or 64 (tiles of 8 rows, a remainder),
    on one thread or two (determinism: README)."""
    pack, op = VNNI[bits]
    linear = getattr(fused, op)
    torch.manual_seed(3)
    w = torch.randn(200, 576)  # 13 tiles of 16 outputs, the last one partial
    packed, sm = pack(w)
    x = torch.randn(64, 576).bfloat16()
    alone = torch.cat([linear(x[i : i + 1], packed, sm, 200) for i in range(64)])
    for rows in (16, 37, 64):
        assert torch.equal(linear(x[:rows], packed, sm, 200), alone[:rows])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(linear(x, packed, sm, 200), alone)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("bits", [4, 8])
def test_vnni_kernels_refuse_what_they_cannot_take(fused: KernelOps, bits: int) -> None:
    pack, op = VNNI[bits]
    linear = getattr(fused, op)
    packed, sm = pack(torch.randn(40, 64))
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="do not fill"):
        linear(x, packed, sm, 49)  # 3 tiles hold 33..48 outputs
    with pytest.raises(RuntimeError, match="for rows of"):
        linear(torch.randn(2, 96), packed, sm, 40)
    with pytest.raises(RuntimeError, match="must be"):
        linear(x, packed, sm.bfloat16(), 40)
    other, other_sm = VNNI[12 - bits][0](torch.randn(40, 64))  # the other kernel's layout
    with pytest.raises(RuntimeError, match="-bit codes"):
        linear(x, other, sm, 40)
    with pytest.raises(RuntimeError, match="scales"):
        linear(x, packed, other_sm, 40)


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"INFERD_FUSED_KERNELS": "0"}, "plain PyTorch ops (INFERD_FUSED_KERNELS=0)"),
        ({"CXX": "/bin/false"}, "plain PyTorch ops (build failed: "),  # no usable compiler
    ],
)
def test_without_the_kernels_everything_runs_on_plain_ops(
    env: dict[str, str], reason: str, tmp_path: Path
) -> None:
    script = (
        "import torch\n"
        "from inferd.kernels import load_ops\n"
        "from inferd.layers.norm import RMSNorm\n"
        "ops = load_ops(torch.float32)\n"
        "print(ops.description)\n"
        "norm = RMSNorm(8, 1e-5)\n"
        "norm.ops = ops\n"
        "print(norm(torch.ones(2, 8)).sum().item())\n"
    )
    run_env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), **env}
    result = subprocess.run(
        [sys.executable, "-c", script], env=run_env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    line, value = result.stdout.splitlines()
    assert line.startswith(reason)
    assert float(value) == pytest.approx(16.0, rel=1e-4)  # ones normalize to ones (eps aside)


def test_doctor_says_what_a_start_would_run_without_building(
    fused: KernelOps, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    isa = kernel_isa()
    assert isa is not None
    assert build_status().startswith(f"fused CPU kernels, {isa.name} build (built for this source")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build_status().startswith(f"fused CPU kernels, {isa.name} build at the first start")
    assert not any(tmp_path.iterdir())  # and nothing was built or staged
    monkeypatch.setenv("INFERD_FUSED_KERNELS", "0")
    assert build_status() == "plain PyTorch ops (INFERD_FUSED_KERNELS=0)"


@pytest.mark.parametrize("rows", [1, 3, 16, 64])
@pytest.mark.parametrize("vocab", [1, 15, 49152, 49155])
def test_argmax_rows_is_torchs_argmax(fused: KernelOps, rows: int, vocab: int) -> None:
    g = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=g)
    # Ties (the first wins), a row of one repeated value, -inf and NaN rows, a max in the tail.
    logits[0, vocab // 2 :] = logits[0].max() + 1
    if rows > 1:
        logits[1] = 0.25
    if rows > 2:
        logits[2] = float("-inf")
    if rows > 3:
        logits[3, -1] = 1e9
        logits[4, vocab // 3] = float("nan")
        logits[5, :] = float("nan")
        logits[6, vocab - 1] = float("nan")
        logits[6, 0] = float("inf")
    got = fused.argmax_rows(logits)
    assert got.dtype == torch.long
    assert torch.equal(got, logits.argmax(dim=-1))
    assert torch.equal(fused.argmax_rows(logits[:, ::1].T.contiguous().T), got)  # strided rows
