"""RMSNorm as Llama-family models define it: normalize in float32, scale in the model dtype; and
as Gemma does (``unit_offset``): scale by ``1 + w`` in float32, round once."""

from __future__ import annotations

import torch
from torch import nn

from inferd.layers.kernel_user import KernelUser
from inferd.layers.registered import Registered


class RMSNorm(nn.Module, KernelUser):
    weight = Registered[nn.Parameter]("_parameters")  # read straight away (layers/registered.py)
    unit_offset = False  # Gemma's norms: weights stored as offsets from one

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps, self.unit_offset)

    def add_forward(
        self, x: torch.Tensor, delta: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + delta, self(x + delta))``: a residual add and this norm in one kernel call;
        ``(x, self(x))`` where there is nothing to add yet (a split-residual model's first
        layer, or its final norm when no layer ran)."""
        if delta is None:
            return x, self.forward(x)
        return self.ops.add_rms_norm(x, delta, self.weight, self.eps, self.unit_offset)
