"""Both kernel-op implementations by name, for tests that run a whole model on each."""

from __future__ import annotations

import torch

from inferd.kernels import load_ops
from inferd.kernels.fused import FusedOps
from inferd.kernels.ops import KernelOps
from inferd.kernels.plain import PlainOps

OPS_NAMES = ["fused", "plain"]


def ops_named(name: str, dtype: torch.dtype = torch.float32) -> KernelOps:
    if name == "plain":
        return PlainOps()
    ops = load_ops(dtype)
    # The machines that run the tests have a compiler: a failed build must fail, not fall back.
    assert isinstance(ops, FusedOps), ops.description
    return ops
