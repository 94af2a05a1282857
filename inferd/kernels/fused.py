"""The kernel ops on the compiled kernels of ``decode.cpp`` (built by ``inferd.kernels``).

Ops without a kernel (torch-packed int4 weights) are the plain ones, and so is the bf16 int8
linear past one row, where torch's kernel wins again.
"""

from __future__ import annotations

from typing import Protocol

import torch

from inferd.kernels.ops import Rotation, StackKernel
from inferd.kernels.plain import PlainOps


class CompiledKernels(Protocol):
    """The functions the extension module exports (``PYBIND11_MODULE`` in decode.cpp)."""

    def rms_norm(
        self, x: torch.Tensor, w: torch.Tensor, eps: float, unit_offset: bool = False
    ) -> torch.Tensor: ...

    def add_rms_norm(
        self,
        x: torch.Tensor,
        delta: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        unit_offset: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def qk_rms_norm(
        self,
        qkv: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        heads: int,
        kv_heads: int,
        eps: float,
        unit_offset: bool,
    ) -> torch.Tensor: ...

    def rope_write_kv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        heads: int,
    ) -> torch.Tensor: ...

    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
        softcap: float,
        window: int,
        grouped: bool = True,  # False: one task per query head (the benchmark's baseline)
    ) -> torch.Tensor: ...

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor: ...

    def gelu_tanh_mul(self, x: torch.Tensor) -> torch.Tensor: ...

    def int8_linear(
        self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor
    ) -> torch.Tensor: ...

    def int4_rows_linear(
        self, x: torch.Tensor, packed: torch.Tensor, scales_and_mins: torch.Tensor
    ) -> torch.Tensor: ...

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor: ...

    def int4_vnni_linear(
        self, x: torch.Tensor, packed: torch.Tensor, scales_and_mins: torch.Tensor, n: int
    ) -> torch.Tensor: ...

    def int8_vnni_linear(
        self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, n: int
    ) -> torch.Tensor: ...


class FusedOps(PlainOps):
    def __init__(self, compiled: CompiledKernels, isa: str) -> None:
        super().__init__(reason="")
        self.compiled = compiled
        self.isa = isa  # the build target (kernels.ISAS; inferd doctor names it)

    @property
    def description(self) -> str:
        return "fused CPU kernels"

    @property
    def stack(self) -> StackKernel | None:
        # A build from an older decode.cpp (benchmarks/step_ab.py --old-kernels) has none.
        return self.compiled if hasattr(self.compiled, "decode_stack") else None  # type: ignore[return-value]

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
    ) -> torch.Tensor:
        # Per-head q/k norms of other callers see strided views: one copy, still fewer passes
        # than the plain ops.
        if weight.dtype != x.dtype:  # a float32 weight on bf16 rows: torch's promotion
            return super().rms_norm(x, weight, eps, unit_offset)
        return self.compiled.rms_norm(x.contiguous(), weight, eps, unit_offset)

    def add_rms_norm(
        self,
        x: torch.Tensor,
        delta: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        unit_offset: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if delta.dtype != x.dtype or weight.dtype != x.dtype:
            # A sum or a scale that promotes: the plain ops do it torch's way.
            return super().add_rms_norm(x, delta, weight, eps, unit_offset)
        return self.compiled.add_rms_norm(
            x.contiguous(), delta.contiguous(), weight, eps, unit_offset
        )

    def qk_rms_norm(
        self,
        qkv: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        eps: float,
        unit_offset: bool = False,
    ) -> torch.Tensor:
        if q_weight.dtype != qkv.dtype or k_weight.dtype != qkv.dtype:
            return super().qk_rms_norm(
                qkv, q_weight, k_weight, num_heads, num_kv_heads, eps, unit_offset
            )
        return self.compiled.qk_rms_norm(
            qkv.contiguous(), q_weight, k_weight, num_heads, num_kv_heads, eps, unit_offset
        )

    def rope_write_kv(
        self,
        qkv: torch.Tensor,
        rotation: Rotation,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        num_heads: int,
    ) -> torch.Tensor:
        if not _kernel_takes(k_cache, qkv):
            return super().rope_write_kv(qkv, rotation, slots, k_cache, v_cache, num_heads)
        return self.compiled.rope_write_kv(
            qkv.contiguous(),
            rotation.positions,
            slots,
            rotation.cos_table,
            rotation.signed_sin_table,
            k_cache,
            v_cache,
            num_heads,
        )

    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
        softcap: float | None,
        window: int,
    ) -> torch.Tensor:
        if not _kernel_takes(k_cache, q):
            return super().decode_attention(
                q, k_cache, v_cache, block_tables, lens, scale, softcap, window
            )
        return self.compiled.decode_attention(
            q.contiguous(), k_cache, v_cache, block_tables, lens, scale, softcap or 0.0, window
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.compiled.silu_mul(gate_up.contiguous())

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.compiled.gelu_tanh_mul(gate_up.contiguous())

    def int4_rows_linear(
        self, x: torch.Tensor, packed: torch.Tensor, scales_and_mins: torch.Tensor
    ) -> torch.Tensor:
        return self.compiled.int4_rows_linear(x.contiguous(), packed, scales_and_mins)

    def int4_vnni_linear(
        self, x: torch.Tensor, packed: torch.Tensor, scales_and_mins: torch.Tensor, out: int
    ) -> torch.Tensor:
        return self.compiled.int4_vnni_linear(x.contiguous(), packed, scales_and_mins, out)

    def int8_vnni_linear(
        self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out: int
    ) -> torch.Tensor:
        return self.compiled.int8_vnni_linear(x.contiguous(), packed, scales, out)

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[1] == 0:
            return super().argmax_rows(logits)
        return self.compiled.argmax_rows(logits.contiguous())

    def int8_linear(
        self, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor
    ) -> torch.Tensor:
        if x.shape[0] == 1 or x.dtype == torch.float32 or x.shape[1] % 32:
            # One row (a lone decode's output head) in bf16: the fused GEMV streams the int8
            # weights 1.8x faster than torch's kernel, which wins again from 4 rows. In float32
            # torch's kernel is ~10x slower than dense at every small batch; and with rows not
            # a multiple of 32 long it reads past them (bf16: garbage that varies by run).
            return self.compiled.int8_linear(x.contiguous(), weight, scales)
        return super().int8_linear(x, weight, scales)


def _kernel_takes(cache: torch.Tensor, x: torch.Tensor) -> bool:
    """The kernels read caches of the activations' dtype or int8 ones; a float cache of another
    dtype (``--kv-cache-dtype bf16`` under a float32 model) runs the plain ops, which cast."""
    return cache.dtype in (x.dtype, torch.int8)
