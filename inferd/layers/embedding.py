"""A token embedding that may keep its table in the packed low-bit layout of the output head.

A vocabulary table is often the largest tensor of a model (Llama 3 8B: 128256 x 4096, 1 GiB in
bf16) while a step reads only its prompt's rows of it. A GGUF file stores it quantized; kept in
that form (the VNNI layout of ``layers/linear.py``, which the tied output head multiplies by
anyway), a lookup dequantizes just the rows it returns, and the dense table never exists.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inferd.layers.linear import INT4_GROUP, VNNI_TILE, Linear, PackedKind


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose table is either its dense weight or ``packed``: a ``Linear``'s
    VNNI copy of the same [vocab, hidden] matrix (``use_packed``; the dense weight is then an
    empty tensor that remembers the dtype)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.packed: Linear | None = None

    def use_packed(self, table: Linear) -> None:
        """Look rows up in ``table``'s packed copy (INT4_VNNI or INT8_VNNI) and drop the dense
        weight."""
        assert table.packed_kind in (PackedKind.INT4_VNNI, PackedKind.INT8_VNNI)
        assert (table.out_features, table.in_features) == (self.num_embeddings, self.embedding_dim)
        self.packed = table
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.embedding(input_ids, self.weight)
        return packed_rows(self.packed, input_ids.reshape(-1)).view(
            *input_ids.shape, self.embedding_dim
        )


def packed_rows(table: Linear, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of ``table``'s VNNI copy, dequantized to its dtype: only those rows' bytes
    are read (layouts: ``pack_int4_vnni``, ``pack_int8_vnni``)."""
    parts = table.vnni_parts()
    assert parts is not None
    packed, scales, bits = parts
    tiles, groups, vectors = packed.shape[:3]
    tile, lane = ids // VNNI_TILE, ids % VNNI_TILE
    # [tile, group, vector, output, 4 bytes]: one output's bytes picked per id.
    picked = packed.view(tiles, groups, vectors, VNNI_TILE, 4)[tile, :, :, lane]
    sm = scales.view(tiles, groups, -1, VNNI_TILE)[tile, :, :, lane].float()  # [n, groups, 1|2]
    if bits == 4:  # vector p: inputs 8p..8p+3 low nibbles, 8p+4..8p+7 high ones
        codes = torch.stack((picked & 0x0F, picked >> 4), dim=-2).view(-1, groups, INT4_GROUP)
        values = codes.float() * sm[..., :1] + sm[..., 1:]
    else:  # vector p: inputs 4p..4p+3, stored plus 128
        codes = picked.reshape(-1, groups, INT4_GROUP)
        values = (codes.float() - 128) * sm[..., :1]
    return values.view(len(ids), groups * INT4_GROUP).to(table.weight.dtype)
