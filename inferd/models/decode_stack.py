"""A decode step's decoder layers in one native call (``decode_stack`` in kernels/decode.cpp).

Layer by layer, a decode step of SmolLM2 makes ~270 kernel calls from Python and spends ~40 us
a layer in the interpreter around them (attribute reads, dtype checks, context lookups,
argument conversion): ~1.2 ms of a 16-row step, and as much of a one-row step
(benchmarks/step_profile.py). The stack gives the same kernels the same tensors in the same
order from C++, so every row gets the same bits as layer by layer (tests/models/
test_decode_stack.py checks it), in one call with the GIL released.

A model builds its stack once, at its first decode step, from what its layers hold (each layer
says how in ``stack_layer``); a model with a part the stack does not take (a projection without
a VNNI copy, a norm weight in another dtype than the activations, M-RoPE positions) has none.
A step takes it when every row decodes (no prompt chunk), the VNNI copies would serve every
projection anyway (``packed_decode``) and no row runs a LoRA adapter; any other step runs layer
by layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from inferd.kernels.ops import StackKernel
from inferd.layers.attention import AttentionMetadata
from inferd.layers.linear import Linear, packed_decode
from inferd.layers.lora import adapters_active
from inferd.layers.norm import RMSNorm
from inferd.layers.rotary import RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]


def stack_projection(kernel: StackKernel, linear: Linear) -> Any | None:
    """A projection as the stack runs it (its VNNI copy and bias), or None without a copy."""
    parts = linear.vnni_parts()
    if parts is None:
        return None
    p = kernel.StackProjection()
    p.packed, p.scales, p.bits = parts
    p.n = linear.out_features
    p.bias = linear.bias
    return p


def shared_norm(norms: Sequence[RMSNorm], dtype: torch.dtype) -> tuple[float, bool] | None:
    """(eps, unit_offset) when the norms of a layer share them and their weights are in
    ``dtype`` (the fused norm's case; FusedOps.rms_norm hands other dtypes to the plain ops)."""
    first = norms[0]
    for norm in norms:
        if (
            norm.weight.dtype != dtype
            or norm.eps != first.eps
            or norm.unit_offset != first.unit_offset
        ):
            return None
    return first.eps, first.unit_offset


@dataclass
class DecodeStack:
    kernel: StackKernel
    layers: list[Any]  # the kernel's StackLayer of each decoder layer
    rotaries: tuple[RotaryEmbedding, ...]  # the tables the layers' ``rotation`` index
    dtype: torch.dtype  # the activations'
    max_rows: int  # the most rows every projection's VNNI copy serves

    def takes(self, rows: int, kv_caches: list[KVCache]) -> bool:
        """Whether a decode step of ``rows`` rows over these caches runs here (module doc)."""
        return (
            packed_decode(rows, self.max_rows)
            and not adapters_active()
            and kv_caches[0][0].dtype in (self.dtype, torch.int8)
        )

    def run(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers on ``x`` (the embeddings): (residual, delta) for the final norm to add."""
        assert meta.decode_block_tables is not None and meta.decode_lens is not None
        return self.kernel.decode_stack(
            self.layers,
            x.contiguous(),
            None,
            positions,
            meta.slot_mapping,
            [r.cos for r in self.rotaries],  # read each step: ``cover`` may grow them
            [r.signed_sin for r in self.rotaries],
            [c[0] for c in kv_caches],
            [c[1] for c in kv_caches],
            meta.decode_block_tables,
            meta.decode_lens,
        )
