"""Paged attention against a contiguous-cache reference, for mixed decode + prefill batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inferd.kernels.kv_quant import SCALE_BYTES, dequantize_rows, quantize_rows
from inferd.kernels.plain import decode_mask, grouped_attention, write_kv
from inferd.layers.attention import AttentionMetadata, PrefillChunk, attend_paged, chunk_mask
from tests.kernels.choice import OPS_NAMES, ops_named

HEADS, KV_HEADS, DIM, BS = 6, 2, 16, 4


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int) -> torch.Tensor:
    """Causal attention of query rows ``first..`` of one sequence over its whole K/V."""
    n, total = q.shape[0], k.shape[0]
    mask = torch.arange(total)[None, :] <= torch.arange(first, first + n)[:, None]
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


@pytest.mark.parametrize("chunks", [(200,), (24,) * 8 + (8,), (129, 70, 1), (63, 2, 135)])
def test_prompt_rows_get_the_same_bits_whatever_the_chunking(chunks: tuple[int, ...]) -> None:
    """A 200-token prompt (several 64-position tiles) attended in one chunk and in chunks whose
    boundaries fall inside tiles, one of a single row (a prefix-cache retry): equal bits."""
    torch.manual_seed(0)
    n, bs, dtype = sum(chunks), 16, torch.bfloat16
    blocks = -(-n // bs)
    table = torch.randperm(blocks + 4)[:blocks] + 1  # scattered, never the null block 0
    k_cache = torch.randn(blocks + 5, bs, KV_HEADS, DIM).to(dtype)  # stale values everywhere
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(n, HEADS, DIM).to(dtype)
    k, v = torch.randn(n, KV_HEADS, DIM).to(dtype), torch.randn(n, KV_HEADS, DIM).to(dtype)
    pos = torch.arange(n)
    write_kv(k_cache, v_cache, k, v, table[pos // bs] * bs + pos % bs)

    def attend(start: int, count: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=torch.empty(0, dtype=torch.long),
            decode_rows=None,
            decode_block_tables=None,
            decode_lens=None,
            prefills=(PrefillChunk(0, count, start, table, chunk_mask(start, count)),),
        )
        rows = q[start : start + count]
        return attend_paged(ops_named("plain"), rows, k_cache, v_cache, meta, scale=0.25)

    whole = attend(0, n)
    starts = [sum(chunks[:i]) for i in range(len(chunks))]
    pieces = torch.cat([attend(s, c) for s, c in zip(starts, chunks, strict=True)])
    assert torch.equal(pieces, whole)
    torch.testing.assert_close(whole.float(), _reference(q, k, v, 0).float(), atol=2e-2, rtol=0)


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
