"""The layers that call kernel ops hold them here, one implementation per model."""

from __future__ import annotations

from inferd.kernels.ops import KernelOps
from inferd.kernels.plain import PLAIN_OPS


class KernelUser:
    """Mixin of a module that calls ``self.ops``: the plain PyTorch ops until its model is given
    others (``LlamaForCausalLM.use_kernels``, once, when the engine is assembled)."""

    ops: KernelOps = PLAIN_OPS
