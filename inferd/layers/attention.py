"""Attention over a paged KV cache.

The cache of one layer is a pool of fixed-size blocks::

    k_cache: [num_blocks, block_size, num_kv_heads, head_dim]

A request owns a list of block ids (its block table). Token ``p`` of a request lives in block
``table[p // block_size]`` at offset ``p % block_size``. New keys and values are written at
their slots first, then each query reads its request's blocks back through the table, so prefill
chunks and decodes share one code path for storage.

Decode tokens (one query each) are attended in one batched call; each prefill chunk is attended
in query tiles of ``PROMPT_TILE`` positions aligned to the start of the sequence.

Why tiles: SDPA's CPU kernel splits its work by the numbers of queries and keys it is given, so a
prompt row attended in one big call and in a chunk of 8 came out with different bits, and a
greedy reply changed with ``max_num_batched_tokens``. Given the same keys (and mask) SDPA gives a
query row the same bits whichever other queries come along (tests/layers/test_paged_attention.py
checks it), so each tile attends over the keys ``[0, tile end)`` whatever part of the tile the
chunk holds: keys past the chunk are masked out (they add exact zeros). A row's bits could still
depend on how many query rows came with it (a matmul's blocking follows its shapes: a prompt
gave different logits first time and on its retry), so every call for a tile has the same
shapes: the queries are padded to the whole tile.

Sliding-window layers: a tile's keys begin where its first row's window does, rounded down to
whole tiles (again a function of the tile alone), so a long prompt's tiles on Gemma 3's 512-key
layers read at most 640 keys each rather than every key before them, and a chunk reads only the
blocks its first tile reaches.

Bidirectional spans (Gemma 3's images): a chunk may name position ranges whose tokens also see
the later tokens of their own range, as transformers' ``token_type_ids`` mask does, on full and
sliding-window layers alike (a window only hides keys behind a query). A tile whose rows reach
into such a range attends over keys up to the range's end (rounded up to whole tiles, so the
shapes depend on the tile and the request alone, not the chunking); the scheduler never ends a
chunk inside a range, so those keys are in the cache by then.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from inferd.kernels.ops import KernelOps
from inferd.kernels.plain import gather_blocks, grouped_attention

# Query tile of prompt attention, in positions (well under the 192 queries where SDPA's CPU
# kernel changes its split).
PROMPT_TILE = 64


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    token_start: int  # first row of this chunk in the flat batch
    num_tokens: int
    start_pos: int  # tokens of this request already in the cache before the chunk
    block_table: torch.Tensor  # [num_blocks_needed] long
    mask: torch.Tensor | None  # [num_tokens, start_pos + num_tokens] bool; None: plain causal
    # [start, end) position ranges whose tokens see each other both ways (module doc): all of
    # the request's, so a tile's shapes do not depend on where chunks cut it
    bidirectional: tuple[tuple[int, int], ...] = ()
    window: int = 0  # a sliding-window layer's: keys this many positions back are hidden (0: none)


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Everything attention needs about one batch, passed explicitly into ``forward``."""

    slot_mapping: torch.Tensor  # [num_tokens] block * block_size + offset of each new K/V
    decode_rows: torch.Tensor | None  # [num_decodes] rows of the flat batch that are decodes
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] (padded with 0)
    decode_lens: torch.Tensor | None  # [num_decodes] keys each decode sees (its position + 1)
    prefills: tuple[PrefillChunk, ...]
    decode_window: int = 0  # sliding-window layers: only the last this many keys (0: all)


def attend_paged(
    ops: KernelOps,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] over keys and values already in the cache.

    Decodes go to ``ops.decode_attention`` in one call, prompt chunks to SDPA one by one.
    ``softcap``: scores become ``softcap * tanh(s / softcap)`` before the softmax (Gemma 2).
    Sliding-window layers pass metadata from ``sliding_window_metadata``.
    """
    if meta.decode_rows is not None and not meta.prefills:
        # Every row decodes, in order: no scatter into a new tensor.
        return _decode(ops, q, k_cache, v_cache, meta, scale, softcap)
    out = torch.empty_like(q)
    if meta.decode_rows is not None:
        decode_q = q[meta.decode_rows]
        out[meta.decode_rows] = _decode(ops, decode_q, k_cache, v_cache, meta, scale, softcap)
    for chunk in meta.prefills:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        out[rows] = _prefill(q[rows], k_cache, v_cache, chunk, scale, softcap)
    return out


def _decode(
    ops: KernelOps,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    tables, lens = meta.decode_block_tables, meta.decode_lens
    assert tables is not None and lens is not None
    return ops.decode_attention(
        q, k_cache, v_cache, tables, lens, scale, softcap, meta.decode_window
    )


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """q [1, heads, n, d]; keys, values [1, kv_heads, T, d]; mask [n, T] (True: attend).

    SDPA, except with soft-capping (which SDPA lacks).
    """
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
    return grouped_attention(q, keys, values, mask, scale, softcap)


def _prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """The chunk's queries, tile by tile over the keys up to each tile's end (module doc).

    Every call for a tile has the same shapes and layout whatever part of the tile the chunk
    holds: the queries are padded to the whole tile (the padding rows attend to key 0 alone and
    are dropped), the keys are a contiguous copy.
    """
    start, total = chunk.start_pos, chunk.start_pos + chunk.num_tokens
    spans = chunk.bidirectional
    padded = -(-total // PROMPT_TILE) * PROMPT_TILE
    padded = _tile_key_end(start - start % PROMPT_TILE, padded, spans)  # the farthest reach
    # A sliding-window layer reads only the blocks its first tile's window reaches.
    block_size = k_cache.shape[1]
    first_block = _tile_key_start(start - start % PROMPT_TILE, chunk.window) // block_size
    base = first_block * block_size  # the position of keys[:, :, 0]
    table = chunk.block_table[first_block:]
    keys = _padded_keys(k_cache, table, padded - base, q.dtype)
    values = _padded_keys(v_cache, table, padded - base, q.dtype)
    mask = _chunk_or_causal_mask(chunk, padded)
    _see_ahead_in_spans(mask, start, spans)
    q = q.transpose(0, 1)  # [heads, n, d]
    out = torch.empty_like(q)
    tile_start = start - start % PROMPT_TILE
    while tile_start < total:
        tile_end = tile_start + PROMPT_TILE
        first, last = max(tile_start, start), min(tile_end, total)
        rows, tile_rows = (
            slice(first - start, last - start),
            slice(first - tile_start, last - tile_start),
        )
        key_start, key_end = (
            _tile_key_start(tile_start, chunk.window),
            _tile_key_end(tile_start, tile_end, spans),
        )
        q_tile = q.new_zeros(1, q.shape[0], PROMPT_TILE, q.shape[2])
        q_tile[0, :, tile_rows] = q[:, rows]
        mask_tile = torch.zeros(PROMPT_TILE, key_end - key_start, dtype=torch.bool)
        mask_tile[:, 0] = True
        mask_tile[tile_rows] = mask[rows, key_start:key_end]
        k_tile = keys[:, :, key_start - base : key_end - base].contiguous()
        v_tile = values[:, :, key_start - base : key_end - base].contiguous()
        attended = _attend(q_tile, k_tile, v_tile, mask_tile, scale, softcap)
        out[:, rows] = attended[0, :, tile_rows]
        tile_start = tile_end
    return out.transpose(0, 1)  # [n, heads, head_dim]


def _see_ahead_in_spans(mask: torch.Tensor, start: int, spans: tuple[tuple[int, int], ...]) -> None:
    """Let each row inside a bidirectional span also see the later keys of its span (in place;
    the keys behind it keep what the causal or windowed mask says)."""
    total = start + mask.shape[0]
    for a, b in spans:
        lo, hi = max(a, start), min(b, total)
        if lo < hi:
            q_pos = torch.arange(lo, hi)[:, None]
            mask[lo - start : hi - start, a:hi] |= torch.arange(a, hi)[None, :] > q_pos


def _tile_key_end(tile_start: int, tile_end: int, spans: tuple[tuple[int, int], ...]) -> int:
    """Keys a query tile attends over: up to its end, or up to the end of a bidirectional span
    that any of its positions lies in, rounded up to whole tiles. It depends on the tile alone,
    not on the part of it a chunk holds, so a tile cut by chunks has the same shapes (keys past
    the chunk are zeros, masked out)."""
    reach = max((b for a, b in spans if a < tile_end and b > tile_start), default=tile_end)
    return max(tile_end, -(-reach // PROMPT_TILE) * PROMPT_TILE)


def _tile_key_start(tile_start: int, window: int) -> int:
    """The first key a query tile attends over: 0, or on a sliding-window layer the first its
    first row's window shows, rounded down to whole tiles (module doc). Like the tile's end it
    depends on the tile alone; the keys before it are hidden from every row of the tile."""
    if window <= 0:
        return 0
    return max(0, tile_start - (window - 1)) // PROMPT_TILE * PROMPT_TILE


def _padded_keys(
    cache: torch.Tensor, table: torch.Tensor, length: int, dtype: torch.dtype
) -> torch.Tensor:
    """[1, kv_heads, length, d] in ``dtype``: the table's keys (an int8 cache's dequantized),
    then zeros (always masked) up to ``length``."""
    keys = gather_blocks(cache, table[None], dtype)
    if keys.shape[2] >= length:
        return keys[:, :, :length]
    return F.pad(keys, (0, 0, 0, length - keys.shape[2]))


def _chunk_or_causal_mask(chunk: PrefillChunk, width: int) -> torch.Tensor:
    """[n, width] bool: the chunk's own mask (causal, maybe windowed), widened with False."""
    start, total = chunk.start_pos, chunk.start_pos + chunk.num_tokens
    if chunk.mask is None:
        q_pos = torch.arange(start, total)[:, None]
        return torch.arange(width)[None, :] <= q_pos
    return F.pad(chunk.mask, (0, width - chunk.mask.shape[1]), value=False)


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
        replace(c, mask=m, window=window)
        if (m := _window_chunk_mask(c, window)) is not None
        else replace(c, window=window)
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
