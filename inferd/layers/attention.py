"""Attention over a paged KV cache.

The cache of one layer is a pool of fixed-size blocks::

    k_cache: [num_blocks, block_size, num_kv_heads, head_dim]

A request owns a list of block ids (its block table). Token ``p`` of a request lives in block
``table[p // block_size]`` at offset ``p % block_size``. New keys and values are written at
their slots first, then each query reads its request's blocks back through the table, so prefill
chunks and decodes share one code path for storage.

Decode tokens (one query each) are attended in one batched call; each prefill chunk gets its own
call with a causal mask offset by the tokens already cached.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from inferd.kernels import fused

SMALL_DECODE_KEYS = 256  # up to here a lone decode attends in float32 (see _decode)


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    token_start: int  # first row of this chunk in the flat batch
    num_tokens: int
    start_pos: int  # tokens of this request already in the cache before the chunk
    block_table: torch.Tensor  # [num_blocks_needed] long
    mask: torch.Tensor | None  # [num_tokens, start_pos + num_tokens] bool; None: plain causal


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Everything attention needs about one batch, passed explicitly into ``forward``."""

    slot_mapping: torch.Tensor  # [num_tokens] block * block_size + offset of each new K/V
    decode_rows: torch.Tensor | None  # [num_decodes] rows of the flat batch that are decodes
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] (padded with 0)
    decode_lens: torch.Tensor | None  # [num_decodes] keys each decode sees (its position + 1)
    prefills: tuple[PrefillChunk, ...]
    decode_window: int = 0  # sliding-window layers: only the last this many keys (0: all)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    # The pool seen as one row per slot: a single index_copy_ per tensor.
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, meta.slot_mapping, v)


def gather_blocks(
    cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """[batch, max_blocks] block ids -> [batch, num_kv_heads, max_blocks * block_size, head_dim].

    Contiguous (and cast to ``dtype`` in the same copy): the CPU matmuls that read it cost
    1.2-1.6x more on the transposed view, copy included (benchmarks/attention.py).
    """
    batch, max_blocks = block_tables.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    blocks = cache.index_select(0, block_tables.reshape(-1))
    blocks = blocks.view(batch, max_blocks * block_size, num_kv_heads, head_dim)
    return blocks.transpose(1, 2).to(dtype or cache.dtype, memory_format=torch.contiguous_format)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].

    ``softcap``: scores become ``softcap * tanh(s / softcap)`` before the softmax (Gemma 2).
    Sliding-window layers pass metadata from ``sliding_window_metadata``.
    """
    write_kv(k_cache, v_cache, k, v, meta)
    return attend_paged(q, k_cache, v_cache, meta, scale, softcap=softcap)


def attend_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of ``q`` over keys and values already in the cache (see ``paged_attention``)."""
    decoding = meta.decode_rows is not None
    if decoding:
        assert meta.decode_block_tables is not None
        if not meta.prefills:  # every row decodes, in order: no scatter into a new tensor
            return _decode(q, k_cache, v_cache, meta, scale, softcap)
    out = torch.empty_like(q)
    if decoding:
        out[meta.decode_rows] = _decode(q[meta.decode_rows], k_cache, v_cache, meta, scale, softcap)
    for chunk in meta.prefills:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        out[rows] = _prefill(q[rows], k_cache, v_cache, chunk, scale, softcap)
    return out


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Prompt chunks: q [1, heads, n, d]; keys, values [1, kv_heads, T, d]; mask [n, T].

    SDPA, except with soft-capping (which SDPA lacks).
    """
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True
        )
    if is_causal:
        n, t = q.shape[2], keys.shape[2]
        mask = torch.ones(n, t, dtype=torch.bool).tril(t - n)
    return grouped_attention(q, keys, values, mask, scale, softcap)


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


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query per sequence. The fused kernel when built; else grouped matmuls, because CPU
    SDPA is slow at one query (5x at 16 sequences, 2-5x for one sequence past 256 keys), and for
    one sequence with few keys in float32, where the matmuls cost less than bf16 ones that small
    (benchmarks/attention.py)."""
    tables, lens = meta.decode_block_tables, meta.decode_lens
    assert tables is not None and lens is not None
    kernels = fused()
    if kernels is not None:
        return kernels.decode_attention(
            q.contiguous(),
            k_cache,
            v_cache,
            tables,
            lens,
            scale,
            softcap or 0.0,
            meta.decode_window,
        )
    batch, max_blocks = tables.shape
    num_keys = max_blocks * k_cache.shape[1]
    small = batch == 1 and num_keys <= SMALL_DECODE_KEYS
    dtype = torch.float32 if small else q.dtype
    keys = gather_blocks(k_cache, tables, dtype)  # [D, kv_heads, L, head_dim]
    values = gather_blocks(v_cache, tables, dtype)
    mask = decode_mask(lens, num_keys, meta.decode_window)
    out = grouped_attention(q.unsqueeze(2).to(dtype), keys, values, mask, scale, softcap)
    return out.squeeze(2).to(q.dtype)  # [D, heads, head_dim]


def _prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    total = chunk.start_pos + chunk.num_tokens
    keys = gather_blocks(k_cache, chunk.block_table[None])[:, :, :total]
    values = gather_blocks(v_cache, chunk.block_table[None])[:, :, :total]
    q = q.transpose(0, 1).unsqueeze(0)
    out = _attend(q, keys, values, chunk.mask, chunk.mask is None, scale, softcap)
    return out[0].transpose(0, 1)  # [n, heads, head_dim]


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


def chunk_mask(start_pos: int, num_tokens: int) -> torch.Tensor | None:
    """Causal mask of a prefill chunk behind ``start_pos`` cached tokens (None: plain causal)."""
    if start_pos == 0:
        return None
    q_pos = torch.arange(start_pos, start_pos + num_tokens)
    return torch.arange(start_pos + num_tokens)[None, :] <= q_pos[:, None]


def sliding_window_metadata(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """``meta`` for a layer that hides keys more than ``window - 1`` positions back.

    Built once per step and shared by every sliding-window layer; the KV cache keeps all keys.
    """
    prefills = tuple(
        replace(c, mask=m) if (m := _window_chunk_mask(c, window)) is not None else c
        for c in meta.prefills
    )
    return replace(meta, prefills=prefills, decode_window=window)


def _window_chunk_mask(chunk: PrefillChunk, window: int) -> torch.Tensor | None:
    """Causal sliding-window mask of a prefill chunk; None when the window hides nothing."""
    total = chunk.start_pos + chunk.num_tokens
    if total <= window:
        return None
    q_pos = torch.arange(chunk.start_pos, total)[:, None]
    key_pos = torch.arange(total)[None, :]
    return (key_pos <= q_pos) & (key_pos > q_pos - window)
