"""A sparse mixture of experts: a router picks ``top_k`` of the experts for each token, and the
token's output is the sum of those experts' gated MLPs, each scaled by its routing weight.

The routing is transformers': a softmax over the router's logits in float32, the ``top_k``
likeliest experts (``torch.topk``, so ties break as there), their probabilities renormalized to
sum to one. Where the weights are rounded is the model's: Qwen3-VL-MoE's router rounds them to
the logits' dtype before they scale the experts' outputs, Gemma 4's keeps them in float32 (the
scaled rows are rounded once).

Each expert is two ``Linear`` projections, as a dense MLP's: ``gate_up_proj[e]`` [2 * ff, hidden]
(its gate rows, then its up rows) and ``down_proj[e]`` [hidden, ff]. So ISQ quantizes them, the
packed int8/int4 kernels serve them and an importance matrix observes them as it does every other
projection (each expert sees only the rows routed to it). They load from transformers' fused
stacks, ``gate_up_proj`` [experts, 2 * ff, hidden] and ``down_proj`` [experts, hidden, ff], one
matrix an expert (``loading/weights.fill``). Each expert runs once per step over the rows routed
to it (gathered, then added back with ``index_add_``), in expert order, as transformers' eager
experts add them; the kernel each expert's projections pick depends on how many rows it got, as
a projection's depends on the step's rows (``layers/linear.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inferd.layers.linear import Linear


def top_k_routing(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``top_k`` experts and their renormalized probabilities (float32)."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), experts


class Experts(nn.Module):
    """``num_experts`` gated MLPs (SwiGLU, or GeGLU with ``gelu``), each run on its rows."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, gelu: bool) -> None:
        super().__init__()
        self.gate_up_proj = nn.ModuleList(
            Linear(hidden, 2 * intermediate) for _ in range(num_experts)
        )
        self.down_proj = nn.ModuleList(Linear(intermediate, hidden) for _ in range(num_experts))
        self.gelu = gelu

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """``x`` [n, hidden], each row's ``experts`` [n, k] and their ``weights`` [n, k] ->
        [n, hidden] in ``x``'s dtype."""
        out = torch.zeros_like(x)
        top_k = experts.shape[1]
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # the (row, slot) pairs grouped by expert
        rows, picked = order // top_k, weights.flatten()[order]
        counts = torch.bincount(flat, minlength=len(self.gate_up_proj)).tolist()
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            end = start + count
            routed = rows[start:end]
            # forward, not __call__: the hot path skips nn.Module's hooks (LlamaMLP's way)
            gate, up = self.gate_up_proj[expert].forward(x[routed]).chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
            y = self.down_proj[expert].forward(act * up) * picked[start:end, None]
            out.index_add_(0, routed, y.to(x.dtype))
            start = end
        return out


class TopKRouter(nn.Module):
    """Qwen's router: expert logits by one matrix (no bias), in the model's dtype; the routing
    weights rounded back to it."""

    def __init__(self, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        weights, experts = top_k_routing(logits, self.top_k)
        return weights.to(logits.dtype), experts


class SparseMoeBlock(nn.Module):
    """An MLP made of experts (Qwen3-VL-MoE's): ``gate`` routes, ``experts`` compute (the
    checkpoint's names)."""

    def __init__(
        self, hidden: int, num_experts: int, top_k: int, intermediate: int, gelu: bool
    ) -> None:
        super().__init__()
        self.gate = TopKRouter(hidden, num_experts, top_k)
        self.experts = Experts(num_experts, hidden, intermediate, gelu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, *self.gate(x))
