"""Rotary position embeddings (the rotate-half form) with linear and llama3 frequency scaling."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from inferd.kernels.ops import Rotation


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """How to stretch rotary frequencies for long contexts; ``kind`` None means plain RoPE."""

    kind: str | None = None  # None | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


def inverse_frequencies(
    head_dim: int,
    base: float,
    scaling: RopeScaling,
    freq_factors: torch.Tensor | None = None,
) -> torch.Tensor:
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if freq_factors is not None:
        # GGUF llama3 models ship the per-frequency divisors precomputed (rope_freqs.weight).
        return (inv / freq_factors.to(torch.float64)).float()
    if scaling.kind == "linear":
        inv = inv / scaling.factor
    elif scaling.kind == "llama3":
        inv = _llama3_scale(inv, scaling)
    elif scaling.kind is not None:
        raise ValueError(f"unsupported rope scaling type {scaling.kind!r}")
    return inv.float()


def _llama3_scale(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are divided by the factor, short ones kept, the band between blended.
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * inv / s.factor + smooth * inv
    out = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(middle, blended, out)


class RotaryEmbedding(nn.Module):
    """Caches cos/sin for every position up to ``max_position`` and applies them by index."""

    def __init__(self, head_dim: int, max_position: int, inv_freq: torch.Tensor) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.inv_freq = inv_freq
        self.cos: torch.Tensor
        self.signed_sin: torch.Tensor
        self._build(max_position)

    def _build(self, max_position: int) -> None:
        t = torch.arange(max_position, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(t, self.inv_freq)  # [max_position, head_dim / 2]
        self.register_buffer("cos", torch.cat((freqs, freqs), dim=-1).cos(), persistent=False)
        # The first half negated: rotate_half(x) * sin == swap_halves(x) * signed_sin.
        signed = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
        self.register_buffer("signed_sin", signed, persistent=False)

    @property
    def max_position(self) -> int:
        return self.cos.shape[0]

    def cover(self, max_position: int) -> None:
        """Grow the tables to ``max_position`` rows (a served context longer than the tables
        built at load, rope-scaled ones included); positions past the tables are refused by
        the kernels."""
        if max_position > self.max_position:
            self._build(max_position)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        """The rotation for these positions, computed once per step and shared by all layers."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)  # [num_tokens, 1, head_dim]
        signed_sin = self.signed_sin[positions].unsqueeze(1).to(dtype)
        return Rotation(cos, signed_sin, positions, self.cos, self.signed_sin)
