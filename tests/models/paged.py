"""Run a model's prompt through the paged-attention path as the runner does, for parity tests.

Media models are checked from given input embeddings (text rows plus encoder rows written over
their placeholders), in prefill chunks that may end anywhere, even inside an image, and
optionally after a prefix already held in the caches (a prefix-cache hit)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from itertools import pairwise
from typing import Any

import torch

from inferd.layers.attention import AttentionMetadata, PrefillChunk, chunk_mask
from inferd.layers.linear import dense_rows

BLOCK_SIZE = 16
Caches = list[tuple[torch.Tensor, torch.Tensor]]


def empty_caches(model: Any, num_tokens: int) -> Caches:
    """Zeroed key and value blocks for ``num_tokens``, plus block 0 that no table names, each
    layer's at its own shape (Gemma 4's global layers)."""
    cfg = model.config
    blocks = (-(-num_tokens // BLOCK_SIZE) + 1, BLOCK_SIZE)
    shapes = [(*blocks, *cfg.kv_shape(layer)) for layer in range(cfg.num_layers)]
    return [(torch.zeros(shape), torch.zeros(shape)) for shape in shapes]


def paged_logits(
    model: Any,
    ids: list[int],
    embeds: torch.Tensor,
    *,
    cuts: Iterable[int] = (),
    first: int = 0,
    positions: torch.Tensor | None = None,
    spans: tuple[tuple[int, int], ...] = (),
    caches: Caches | None = None,
    dense: bool = False,
) -> torch.Tensor:
    """Logits of positions ``first..`` in prefill chunks ending at ``cuts``.

    ``positions`` overrides the plain 0..n-1 (M-RoPE's three rows); ``spans`` are ranges whose
    tokens attend both ways; ``caches`` may already hold the keys before ``first``; ``dense``
    runs the linear layers as for prompt rows."""
    n = len(ids)
    caches = empty_caches(model, n) if caches is None else caches
    table = torch.arange(1, -(-n // BLOCK_SIZE) + 1)
    bounds = [first, *sorted(c for c in set(cuts) if first < c < n), n]
    out = []
    with torch.inference_mode(), dense_rows() if dense else contextlib.nullcontext():
        for start, end in pairwise(bounds):
            pos = torch.arange(start, end)
            mask = chunk_mask(start, end - start)
            chunk = PrefillChunk(0, end - start, start, table, mask, spans)
            meta = AttentionMetadata(
                slot_mapping=table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE,
                decode_rows=None,
                decode_block_tables=None,
                decode_lens=None,
                prefills=(chunk,),
            )
            rows = pos if positions is None else positions[..., start:end]
            tokens = torch.tensor(ids[start:end])
            hidden = model(tokens, rows, meta, caches, embeds=embeds[start:end])
            out.append(model.compute_logits(hidden))
    return torch.cat(out)


def image_embeddings(model: Any, ids: list[int], pixels: list[torch.Tensor]) -> torch.Tensor:
    """Token embeddings with each image's encoder rows written over its placeholder tokens."""
    with torch.inference_mode():
        x = model.embed(torch.tensor(ids)).clone()
        if pixels:
            mask = torch.tensor(ids) == model.image_token_id
            x[mask] = torch.cat([model.encode_images(p) for p in pixels])
    return x
