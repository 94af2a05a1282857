"""The kernel ops in plain PyTorch: the reference the fused kernels are tested against, and what
runs where those cannot (no compiler, ``INFERD_FUSED_KERNELS=0``, a dtype they do not take)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inferd.kernels.kv_quant import dequantize_rows, head_dim_of, is_quantized, quantize_rows
from inferd.kernels.ops import KernelOps, Rotation

# torch's int8 weight-only kernel reads each row in whole blocks of 32: past the end of a row of
# another length (garbage in bf16, a crash at times: a mixture of experts' down projection 24
# wide), so such rows and the weight are padded with zeros to it.
INT8_PACK_BLOCK = 32

SMALL_DECODE_KEYS = 256  # up to here a lone decode attends in float32 (see decode_attention)


class PlainOps(KernelOps):
    def __init__(self, reason: str = "the reference ops") -> None:
        self.reason = reason  # why these run rather than the fused kernels

    @property
    def description(self) -> str:
        return f"plain PyTorch ops ({self.reason})"

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
    ) -> torch.Tensor:
        if unit_offset:  # Gemma: scaled in float32, rounded once
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
            return (x32 * (1.0 + weight.float())).to(x.dtype)
        if x.dtype == torch.float32:  # one aten kernel; same arithmetic as below
            return F.rms_norm(x, weight.shape, weight, eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    def add_rms_norm(
        self,
        x: torch.Tensor,
        delta: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        unit_offset: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        total = x + delta
        return total, self.rms_norm(total, weight, eps, unit_offset)

    def qk_rms_norm(
        self,
        qkv: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        eps: float,
        unit_offset: bool = False,
    ) -> torch.Tensor:
        n, dim = qkv.shape[0], q_weight.shape[0]
        q, k, v = qkv.split([num_heads * dim, num_kv_heads * dim, num_kv_heads * dim], dim=-1)
        q = self.rms_norm(q.reshape(n, num_heads, dim), q_weight, eps, unit_offset)
        k = self.rms_norm(k.reshape(n, num_kv_heads, dim), k_weight, eps, unit_offset)
        return torch.cat((q.flatten(1), k.flatten(1), v), dim=-1)

    def rope_write_kv(
        self,
        qkv: torch.Tensor,
        rotation: Rotation,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        num_heads: int,
    ) -> torch.Tensor:
        n, kv_heads, head_dim = qkv.shape[0], k_cache.shape[2], head_dim_of(k_cache)
        qk_size = (num_heads + kv_heads) * head_dim
        v = qkv[:, qk_size:].view(n, kv_heads, head_dim)
        qk = qkv[:, :qk_size].view(n, num_heads + kv_heads, head_dim)
        # Queries and keys are rotated together: one set of kernels instead of two.
        if rotation.dim == head_dim:
            qk = rotation.apply(qk)
        else:  # partial rotary: the rest of each head passes through
            qk = torch.cat((rotation.apply(qk[..., : rotation.dim]), qk[..., rotation.dim :]), -1)
        q, k = qk.split([num_heads, kv_heads], dim=1)
        write_kv(k_cache, v_cache, k, v, slots)
        return q

    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
        softcap: float | None,
        window: int,
    ) -> torch.Tensor:
        """Grouped matmuls, because CPU SDPA is slow at one query (5x at 16 sequences, 2-5x for
        one sequence past 256 keys); for one sequence with few keys in float32, where the
        matmuls cost less than bf16 ones that small (benchmarks/attention.py). An int8 cache is
        dequantized into float32 and attended there, as the fused kernel does."""
        batch, max_blocks = block_tables.shape
        num_keys = max_blocks * k_cache.shape[1]
        small = batch == 1 and num_keys <= SMALL_DECODE_KEYS
        dtype = torch.float32 if small or is_quantized(k_cache) else q.dtype
        keys = gather_blocks(k_cache, block_tables, dtype)  # [D, kv_heads, L, head_dim]
        values = gather_blocks(v_cache, block_tables, dtype)
        mask = decode_mask(lens, num_keys, window)
        out = grouped_attention(q.unsqueeze(2).to(dtype), keys, values, mask, scale, softcap)
        return out.squeeze(2).to(q.dtype)  # [D, heads, head_dim]

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def int4_linear(
        self, x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int
    ) -> torch.Tensor:
        # torch's direct binding: ~1 us less per call than torch.ops.aten's Python wrapper.
        return torch._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)

    def int4_rows_linear(
        self, x: torch.Tensor, packed: torch.Tensor, scales_and_mins: torch.Tensor
    ) -> torch.Tensor:
        return F.linear(x, unpack_int4_rows(packed, scales_and_mins).to(x.dtype))

    def int4_vnni_linear(
        self, x: torch.Tensor, packed: torch.Tensor, scales_and_mins: torch.Tensor, out: int
    ) -> torch.Tensor:
        return _vnni_linear(x, unpack_vnni(packed, scales_and_mins, out))

    def int8_vnni_linear(
        self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out: int
    ) -> torch.Tensor:
        return _vnni_linear(x, unpack_vnni(packed, scales, out))

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)

    def int8_linear(
        self, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor
    ) -> torch.Tensor:
        pad = -x.shape[1] % INT8_PACK_BLOCK
        if pad:  # zero columns add nothing to the sums
            x, weight = F.pad(x, (0, pad)), F.pad(weight, (0, pad))
        return torch._weight_int8pack_mm(x, weight, scales)


def unpack_int4_rows(packed: torch.Tensor, scales_and_mins: torch.Tensor) -> torch.Tensor:
    """The float32 weight [out, in] of ``linear.pack_int4_rows``'s layout: the reference (a
    dense copy per call: only for tests and machines without the compiled kernels)."""
    out = packed.shape[0]
    groups = packed.view(out, -1, 1, 16)
    codes = torch.cat((groups & 0x0F, groups >> 4), dim=2).view(out, -1, 32).float()
    w = codes * scales_and_mins[..., :1] + scales_and_mins[..., 1:]
    return w.view(out, -1)


def unpack_vnni(
    packed: torch.Tensor, scales: torch.Tensor, out: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``linear.pack_int4_vnni``'s or ``pack_int8_vnni``'s layout (4 or 8 vectors a group) ->
    (codes [out, groups, 32], scale and min [out, groups]), float32: the weight is ``codes *
    scale + min`` (int8: the signed codes, min 0)."""
    tiles, groups, vectors = packed.shape[:3]
    sm = scales.float().permute(0, 3, 1, 2).reshape(tiles * 16, groups, -1)[:out]
    if vectors == 4:
        v = packed.view(tiles, groups, 4, 1, 16, 4)
        c = torch.cat((v & 0x0F, v >> 4), dim=3).flatten(2, 3)  # [tile, group, p half, o, i]
        lo, offset = sm[..., 1], 0
    else:
        c = packed.view(tiles, groups, 8, 16, 4)  # [tile, group, p, o, i]
        lo, offset = torch.zeros_like(sm[..., 0]), 128  # stored plus 128
    codes = c.permute(0, 3, 1, 2, 4).reshape(tiles * 16, groups, 32)[:out].float() - offset
    return codes, sm[..., 0], lo


def _vnni_linear(
    x: torch.Tensor, weight: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """The VNNI kernels' arithmetic: int8 rows against unpacked codes, scales and mins."""
    codes, scale, lo = weight
    xq, xs, xsum = quantize_groups(x)
    # Integer dot products per group: exact in float32 (at most 32 * 127 * 127 < 2**24).
    dot = torch.einsum("rgi,ngi->rng", xq, codes)
    y = (dot * (scale[None] * xs[:, None])).sum(-1) + (lo[None] * xsum[:, None]).sum(-1)
    return y.to(x.dtype)


QMAX_INV = torch.tensor(1 / 127, dtype=torch.float32)


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows [r, k] -> int8 codes (as float32) [r, k/32, 32], scales and sums [r, k/32]: per
    group of 32, scale = absmax / 127 and code = round-half-even(x * (1 / scale)), the compiled
    kernel's arithmetic step for step. The sum is the quantized group's, scale * sum(codes),
    for the weights' min term (decode.cpp says why not x's own)."""
    g = x.float().view(x.shape[0], -1, 32)
    scale = g.abs().amax(-1) * QMAX_INV
    inv = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))
    codes = (g * inv[..., None]).round().clamp(-127, 127)
    return codes, scale, scale * codes.sum(-1)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """k, v [n, kv_heads, head_dim] into the caches at ``slots``: as they are, cast to a float
    cache's dtype, or quantized into an int8 cache's rows (inferd/kernels/kv_quant.py)."""
    if is_quantized(k_cache):
        k, v = quantize_rows(k), quantize_rows(v)
    # The pool seen as one row per slot: a single index_copy_ per tensor.
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def gather_blocks(
    cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """[batch, max_blocks] block ids -> [batch, num_kv_heads, max_blocks * block_size, head_dim].

    Contiguous (and cast to ``dtype`` in the same copy): the CPU matmuls that read it cost
    1.2-1.6x more on the transposed view, copy included (benchmarks/attention.py). An int8
    cache's rows are dequantized into ``dtype``, which it then needs.
    """
    batch, max_blocks = block_tables.shape
    _, block_size, num_kv_heads, width = cache.shape
    blocks = cache.index_select(0, block_tables.reshape(-1))
    blocks = blocks.view(batch, max_blocks * block_size, num_kv_heads, width)
    if is_quantized(cache):
        assert dtype is not None, "an int8 cache dequantizes into a float dtype"
        blocks = dequantize_rows(blocks, dtype)
    return blocks.transpose(1, 2).to(dtype or cache.dtype, memory_format=torch.contiguous_format)


def grouped_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention with query heads grouped over their shared KV head (no repeated K/V copies)."""
    batch, heads, n, dim = q.shape
    kv_heads = keys.shape[1]
    qg = q.reshape(batch, kv_heads, heads // kv_heads * n, dim)  # [B, kv, group * n, d]
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale
    scores = scores.view(batch, kv_heads, heads // kv_heads, n, -1)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:  # [.., n, T] -> broadcast over the kv and group dims
        m = mask if mask.dim() == 2 else mask.reshape(mask.shape[0], 1, 1, n, -1)
        scores = scores.masked_fill(~m, float("-inf"))
    probs = scores.softmax(-1).to(values.dtype).view(batch, kv_heads, -1, scores.shape[-1])
    return torch.matmul(probs, values).view(batch, heads, n, dim)


def decode_mask(lens: torch.Tensor, num_keys: int, window: int = 0) -> torch.Tensor | None:
    """Keys each decode may see, [num_decodes, 1, 1, num_keys]: the first ``lens`` of its
    padded row, and of those only the last ``window`` when one is set. None when all may."""
    if bool((lens == num_keys).all()) and (window == 0 or window >= num_keys):
        return None
    keys = torch.arange(num_keys)[None, :]
    visible = keys < lens[:, None]
    if window:
        visible &= keys >= lens[:, None] - window
    return visible[:, None, None, :]


PLAIN_OPS = PlainOps()
