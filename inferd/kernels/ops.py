"""The kernel ops a decoder layer calls, as one typed interface with two implementations.

``PlainOps`` (inferd/kernels/plain.py) composes PyTorch ops and is the reference;
``FusedOps`` (inferd/kernels/fused.py) runs the compiled kernels of ``decode.cpp`` where they
exist. A model is given one of them once, when its engine is assembled (``load_ops``), and each
layer calls ``self.ops.<op>(...)`` on that one path: nothing decides per call which
implementation runs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True, slots=True)
class Rotation:
    """The rotary embedding of one step's positions, computed once and shared by all layers."""

    cos: torch.Tensor  # [num_tokens, 1, rotary_dim] in the model dtype
    signed_sin: torch.Tensor  # sin with its first half negated, same shape
    # What the fused kernel reads instead: positions and the float32 tables they index.
    positions: torch.Tensor  # [num_tokens] long
    cos_table: torch.Tensor  # [max_position, rotary_dim] float32
    signed_sin_table: torch.Tensor

    @property
    def dim(self) -> int:
        """Rotated channels of each head (less than the head size under partial rotary)."""
        return self.cos_table.shape[-1]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, heads, rotary_dim] (any number of heads: q and k may go together).

        ``x * cos + rotate_half(x) * sin`` in three kernels: the half swap is one flip.
        """
        swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
        return torch.addcmul(x * self.cos, swapped, self.signed_sin)


class StackKernel(Protocol):
    """``decode_stack`` and the classes describing its layers (``kernels/decode.cpp``)."""

    StackLayer: Callable[[], Any]
    StackProjection: Callable[[], Any]

    def decode_stack(
        self,
        layers: Sequence[Any],
        x: torch.Tensor,
        delta: torch.Tensor | None,
        positions: torch.Tensor,
        slots: torch.Tensor,
        cos: Sequence[torch.Tensor],
        signed_sin: Sequence[torch.Tensor],
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
        block_tables: torch.Tensor,
        lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class KernelOps(ABC):
    """RMSNorm, RoPE with the paged K/V write, one-query paged attention, the gated
    activations and the weight-only linear variants.

    Tensors are CPU tensors in the model dtype unless a signature says otherwise; the paged
    caches are ``[num_blocks, block_size, num_kv_heads, head_dim]``.
    """

    @property
    @abstractmethod
    def description(self) -> str:
        """One line for the startup banner and ``/v1/system/info``: which ops run, and why."""

    @property
    def stack(self) -> StackKernel | None:
        """The kernel that runs a decode step's decoder layers in one call
        (``models/decode_stack.py``), where these ops have one."""
        return None

    @abstractmethod
    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
    ) -> torch.Tensor:
        """``weight * round(x / rms(x))``: normalized in float32, rounded to x's dtype, scaled.
        ``unit_offset`` (Gemma): ``round((x / rms(x)) * (1 + weight))``, all in float32."""

    @abstractmethod
    def add_rms_norm(
        self,
        x: torch.Tensor,
        delta: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        unit_offset: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and the norm after it: ``(x + delta, rms_norm(x + delta))``, the
        sum rounded to x's dtype as ``+`` rounds it; the same bits as the two ops apart."""

    @abstractmethod
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
        """Fused QKV rows [n, (num_heads + 2 * num_kv_heads) * head_dim] with each q and k head
        through ``rms_norm`` (its own weight, [head_dim]) and v as it was (Qwen3, Gemma 3)."""

    @abstractmethod
    def rope_write_kv(
        self,
        qkv: torch.Tensor,
        rotation: Rotation,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        num_heads: int,
    ) -> torch.Tensor:
        """qkv: [n, (num_heads + 2 * kv_heads) * head_dim] rows laid out [q | k | v].

        Rotates q and k (the first ``rotation.dim`` channels of each head), writes k and v at
        ``slots`` ([n] long, block * block_size + offset) and returns q, [n, num_heads,
        head_dim].
        """

    @abstractmethod
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
        """One query per sequence over its paged keys. q: [batch, heads, head_dim];
        block_tables: [batch, max_blocks] long; lens: [batch] keys each query sees.

        ``softcap``: scores become ``softcap * tanh(s / softcap)``; ``window`` > 0: only the last
        ``window`` keys are visible. Returns [batch, heads, head_dim].
        """

    @abstractmethod
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up over rows laid out [gate | up]: [n, 2 * inter] -> [n, inter]."""

    @abstractmethod
    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GELU(gate, tanh approximation) * up, laid out as for ``silu_mul`` (Gemma's GeGLU)."""

    @abstractmethod
    def int4_linear(
        self, x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int
    ) -> torch.Tensor:
        """x @ w^T for int4 weights in torch's CPU pack (``linear.int4_kernel_tensors``)."""

    @abstractmethod
    def int4_rows_linear(
        self, x: torch.Tensor, packed: torch.Tensor, scales_and_mins: torch.Tensor
    ) -> torch.Tensor:
        """x @ w^T for int4 weights in inferd's row layout (``linear.pack_int4_rows``): packed
        uint8 [out, in/2], float32 scale and min per group of 32 [out, in/32, 2]."""

    @abstractmethod
    def int4_vnni_linear(
        self, x: torch.Tensor, packed: torch.Tensor, scales_and_mins: torch.Tensor, out: int
    ) -> torch.Tensor:
        """x @ w^T with int4 weights in the int4 x int8 kernel's layout
        (``linear.pack_int4_vnni``) and x quantized to int8 per group of 32 on the way in
        (``plain.quantize_groups``); ``out`` outputs of the padded tiles of 16."""

    @abstractmethod
    def int8_vnni_linear(
        self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out: int
    ) -> torch.Tensor:
        """x @ w^T with int8 weights in the int8 x int8 kernel's layout
        (``linear.pack_int8_vnni``: a scale per group of 32), x quantized as for
        ``int4_vnni_linear``."""

    @abstractmethod
    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's index of its largest value, as ``argmax(dim=-1)``: the first of equal
        maxima, the first NaN of a row holding one. logits: [rows, vocab] -> [rows] long."""

    @abstractmethod
    def int8_linear(
        self, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor
    ) -> torch.Tensor:
        """x @ (weight * scales)^T: int8 weight [out, in], one scale per output row, x 2-D."""
