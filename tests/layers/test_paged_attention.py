"""Paged attention against a contiguous-cache reference, for mixed decode + prefill batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inferd.kernels.kv_quant import SCALE_BYTES, dequantize_rows, quantize_rows
from inferd.kernels.plain import decode_mask, grouped_attention, write_kv
from inferd.layers.attention import (
    AttentionMetadata,
    PrefillChunk,
    attend_paged,
    chunk_mask,
    sliding_window_metadata,
)
from tests.kernels.choice import OPS_NAMES, ops_named

HEADS, KV_HEADS, DIM, BS = 6, 2, 16, 4


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, window: int = 0
) -> torch.Tensor:
    """Causal attention of query rows ``first..`` of one sequence over its whole K/V (over the
    last ``window`` keys of each row when given)."""
    n, total = q.shape[0], k.shape[0]
    keys, rows = torch.arange(total)[None, :], torch.arange(first, first + n)[:, None]
    mask = (keys <= rows) & ((keys > rows - window) if window else True)
    kk = k.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)
    vv = v.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask, scale=0.25)
    return out.transpose(0, 1)


@pytest.mark.parametrize("ops_name", OPS_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_matches_contiguous_reference(dtype: torch.dtype, ops_name: str) -> None:
    torch.manual_seed(0)
    # Three sequences: two decoding (lengths 7 and 13), one prefilling tokens 5..10 of 11.
    lengths, firsts = [7, 13, 11], [6, 12, 5]
    tables = [[3, 9], [1, 4, 7, 2], [8, 5, 6]]  # deliberately scattered block ids
    seqs = [
        (torch.randn(n, HEADS, DIM), torch.randn(n, KV_HEADS, DIM), torch.randn(n, KV_HEADS, DIM))
        for n in lengths
    ]
    k_cache = torch.zeros(10, BS, KV_HEADS, DIM, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    # Earlier steps wrote each sequence's first tokens into its blocks.
    for (_, k, v), table, first in zip(seqs, tables, firsts, strict=True):
        for p in range(first):
            k_cache[table[p // BS], p % BS] = k[p].to(dtype)
            v_cache[table[p // BS], p % BS] = v[p].to(dtype)
    rows = [(i, p) for i, first in enumerate(firsts) for p in range(first, lengths[i])]
    q = torch.stack([seqs[i][0][p] for i, p in rows]).to(dtype)
    k = torch.stack([seqs[i][1][p] for i, p in rows]).to(dtype)
    v = torch.stack([seqs[i][2][p] for i, p in rows]).to(dtype)
    tbl = [torch.tensor(t) for t in tables]
    decode_tables = torch.tensor([tables[0] + [0, 0], tables[1]])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([tables[i][p // BS] * BS + p % BS for i, p in rows]),
        decode_rows=torch.tensor([0, 1]),
        decode_block_tables=decode_tables,
        decode_lens=torch.tensor([7, 13]),
        prefills=(PrefillChunk(2, 6, 5, tbl[2], chunk_mask(5, 6)),),
    )
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = attend_paged(ops_named(ops_name), q, k_cache, v_cache, meta, scale=0.25).float()
    expected = torch.cat(
        [
            _reference(
                s[0][f:].to(dtype).float(), s[1].to(dtype).float(), s[2].to(dtype).float(), f
            )
            for s, f in zip(seqs, firsts, strict=True)
        ]
    )
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


def test_grouped_attention_equals_sdpa_with_repeated_heads() -> None:
    torch.manual_seed(1)
    q = torch.randn(5, HEADS, 1, DIM)
    keys, values = torch.randn(5, KV_HEADS, 9, DIM), torch.randn(5, KV_HEADS, 9, DIM)
    mask = decode_mask(torch.tensor([4, 9, 1, 6, 9]), 9)
    assert mask is not None
    expected = F.scaled_dot_product_attention(
        q, keys.repeat_interleave(3, 1), values.repeat_interleave(3, 1), attn_mask=mask, scale=0.3
    )
    torch.testing.assert_close(grouped_attention(q, keys, values, mask, 0.3), expected)


class _Prompt:
    """One sequence's q, k, v of ``n`` tokens, its K/V written through a scattered table."""

    def __init__(self, n: int, bs: int = 16, dtype: torch.dtype = torch.bfloat16) -> None:
        torch.manual_seed(0)
        blocks = -(-n // bs)
        self.table = torch.randperm(blocks + 4)[:blocks] + 1  # scattered, never the null block
        self.k_cache = torch.randn(blocks + 5, bs, KV_HEADS, DIM).to(dtype)  # stale values
        self.v_cache = torch.randn_like(self.k_cache)
        self.q = torch.randn(n, HEADS, DIM).to(dtype)
        self.k = torch.randn(n, KV_HEADS, DIM).to(dtype)
        self.v = torch.randn(n, KV_HEADS, DIM).to(dtype)
        pos = torch.arange(n)
        slots = self.table[pos // bs] * bs + pos % bs
        write_kv(self.k_cache, self.v_cache, self.k, self.v, slots)

    def attend(self, start: int, count: int, window: int = 0) -> torch.Tensor:
        """Rows start.. of the prompt as one prefill chunk (of a sliding-window layer, as the
        models build its metadata, when ``window`` is given)."""
        chunk = PrefillChunk(0, count, start, self.table, chunk_mask(start, count))
        meta = AttentionMetadata(
            slot_mapping=torch.empty(0, dtype=torch.long),
            decode_rows=None,
            decode_block_tables=None,
            decode_lens=None,
            prefills=(chunk,),
        )
        if window:
            meta = sliding_window_metadata(meta, window)
        rows = self.q[start : start + count]
        return attend_paged(ops_named("plain"), rows, self.k_cache, self.v_cache, meta, 0.25)


@pytest.mark.parametrize("window", [0, 20, 70])
@pytest.mark.parametrize("chunks", [(200,), (24,) * 8 + (8,), (129, 70, 1), (63, 2, 135)])
def test_prompt_rows_get_the_same_bits_whatever_the_chunking(
    chunks: tuple[int, ...], window: int
) -> None:
    """A 200-token prompt (several 64-position tiles) attended in one chunk and in chunks whose
    boundaries fall inside tiles, one of a single row (a prefix-cache retry): equal bits, on
    full layers and on sliding-window ones (whose tiles start past the keys their window
    hides)."""
    prompt = _Prompt(sum(chunks))
    whole = prompt.attend(0, prompt.q.shape[0], window)
    starts = [sum(chunks[:i]) for i in range(len(chunks))]
    pieces = torch.cat([prompt.attend(s, c, window) for s, c in zip(starts, chunks, strict=True)])
    assert torch.equal(pieces, whole)
    expected = _reference(prompt.q, prompt.k, prompt.v, 0, window)
    torch.testing.assert_close(whole.float(), expected.float(), atol=2e-2, rtol=0)


def test_sliding_window_chunks_do_not_read_the_keys_behind_their_tiles() -> None:
    """A chunk at positions 128..199 of a 20-key window layer: its tiles' windows begin at 64
    or later, so the blocks of positions 0..63 are not read (NaN there would reach every row:
    masked scores are added to, not replaced), and a uniform-window model may have handed them
    on to another request already."""
    prompt = _Prompt(200)
    prompt.k_cache[prompt.table[:4]] = float("nan")
    prompt.v_cache[prompt.table[:4]] = float("nan")
    tail = prompt.attend(128, 72, window=20)
    expected = _reference(prompt.q[128:], prompt.k, prompt.v, 128, window=20)
    torch.testing.assert_close(tail.float(), expected.float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("ops_name", OPS_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_over_an_int8_cache(dtype: torch.dtype, ops_name: str) -> None:
    """Decodes and a prefill chunk over int8 blocks: the reference over the values the rows
    hold (each quantized with its own scale), and the unquantized one within int8's error."""
    torch.manual_seed(1)
    lengths, firsts = [7, 13, 11], [6, 12, 5]
    tables = [[3, 9], [1, 4, 7, 2], [8, 5, 6]]
    seqs = [
        (torch.randn(n, HEADS, DIM), torch.randn(n, KV_HEADS, DIM), torch.randn(n, KV_HEADS, DIM))
        for n in lengths
    ]
    k_cache = torch.zeros(10, BS, KV_HEADS, DIM + SCALE_BYTES, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    slots = [
        [table[p // BS] * BS + p % BS for p in range(n)]
        for table, n in zip(tables, lengths, strict=True)
    ]
    for (_, k, v), s, first in zip(seqs, slots, firsts, strict=True):  # earlier steps' writes
        write_kv(
            k_cache, v_cache, k[:first].to(dtype), v[:first].to(dtype), torch.tensor(s[:first])
        )
    rows = [(i, p) for i, first in enumerate(firsts) for p in range(first, lengths[i])]
    q = torch.stack([seqs[i][0][p] for i, p in rows]).to(dtype)
    k = torch.stack([seqs[i][1][p] for i, p in rows]).to(dtype)
    v = torch.stack([seqs[i][2][p] for i, p in rows]).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([slots[i][p] for i, p in rows]),
        decode_rows=torch.tensor([0, 1]),
        decode_block_tables=torch.tensor([tables[0] + [0, 0], tables[1]]),
        decode_lens=torch.tensor([7, 13]),
        prefills=(PrefillChunk(2, 6, 5, torch.tensor(tables[2]), chunk_mask(5, 6)),),
    )
    ops = ops_named(ops_name, dtype)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = attend_paged(ops, q, k_cache, v_cache, meta, scale=0.25).float()

    def held(x: torch.Tensor) -> torch.Tensor:  # what an int8 row gives back, in dtype
        return dequantize_rows(quantize_rows(x.to(dtype)), dtype).float()

    stored = torch.cat(
        [
            _reference(s[0][f:].to(dtype).float(), held(s[1]), held(s[2]), f)
            for s, f in zip(seqs, firsts, strict=True)
        ]
    )
    exact = torch.cat(
        [
            _reference(
                s[0][f:].to(dtype).float(), s[1].to(dtype).float(), s[2].to(dtype).float(), f
            )
            for s, f in zip(seqs, firsts, strict=True)
        ]
    )
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out, stored, atol=tol, rtol=tol)
    assert float((out - exact).abs().max()) < 0.1
