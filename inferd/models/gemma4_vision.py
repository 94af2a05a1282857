"""Gemma 4's image encoder and the projection of an encoder's rows into the text model.

An image arrives as its patches (models/gemma4_image.py: any aspect, a multiple of
``pooling`` patches a side) with each patch's (x, y) place in the grid. The encoder:

- embeds each patch linearly from pixels mapped to [-1, 1], plus a learned row of the x table
  and one of the y table;
- runs Gemma 4-style layers over all of an image's patches both ways: sandwich norms scaling
  by ``w``, per-head q/k norms and weightless value norms, unscaled attention, 2-D RoPE (a
  head's first half turns with x, its second half with y), GeGLU; with ``clipped_linears``
  every projection clamps its input and output to bounds stored in the checkpoint;
- averages each ``pooling x pooling`` block of the grid into one soft token (row-major over
  the pooled grid), scales by ``sqrt(hidden)`` in float32 and, with ``standardize``, shifts
  and scales each channel;
- projects each token (weightless RMS norm, then a linear map) into the text model's width.

Submodule names follow the checkpoint's (``vision_tower.encoder.layers.N...``,
``embed_vision.embedding_projection``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inferd.layers.linear import Linear
from inferd.models.config import Gemma4VisionConfig
from inferd.models.gemma4 import Gemma4RMSNorm, unit_rms


class ClippableLinear(nn.Module):
    """A bias-free projection that may clamp its input and output (``clipped``)."""

    def __init__(self, in_features: int, out_features: int, clipped: bool) -> None:
        super().__init__()
        self.linear = Linear(in_features, out_features)
        self.clipped = clipped
        if clipped:
            inf = torch.tensor(float("inf"))
            self.input_min = nn.Parameter(-inf, requires_grad=False)
            self.input_max = nn.Parameter(inf.clone(), requires_grad=False)
            self.output_min = nn.Parameter(-inf.clone(), requires_grad=False)
            self.output_max = nn.Parameter(inf.clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        x = torch.clamp(x, self.input_min, self.input_max)
        return torch.clamp(self.linear(x), self.output_min, self.output_max)


def rotate_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [n, heads, D]; cos, sin: [n, 2, D / 2] (per axis). Each half of a head turns, in the
    rotate-half form, by its axis's angles."""
    halves = []
    for axis, part in enumerate(x.chunk(2, dim=-1)):
        c, s = cos[:, None, axis], sin[:, None, axis]
        first, second = part.chunk(2, dim=-1)
        halves.append(part * c + torch.cat((-second, first), dim=-1) * s)
    return torch.cat(halves, dim=-1)


class Gemma4VisionAttention(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        h, d, clip = cfg.hidden_size, cfg.head_dim, cfg.clipped_linears
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.eps = cfg.rms_norm_eps
        self.q_proj = ClippableLinear(h, cfg.num_heads * d, clip)
        self.k_proj = ClippableLinear(h, cfg.num_kv_heads * d, clip)
        self.v_proj = ClippableLinear(h, cfg.num_kv_heads * d, clip)
        self.o_proj = ClippableLinear(cfg.num_heads * d, h, clip)
        self.q_norm = Gemma4RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = Gemma4RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q = rotate_2d(self.q_norm(self.q_proj(x).view(n, self.heads, self.head_dim)), cos, sin)
        k = rotate_2d(self.k_norm(self.k_proj(x).view(n, self.kv_heads, self.head_dim)), cos, sin)
        v = unit_rms(self.v_proj(x).view(n, self.kv_heads, self.head_dim), self.eps)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=1.0
        )
        return self.o_proj(out.transpose(0, 1).reshape(n, self.heads * self.head_dim))


class Gemma4VisionMLP(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        h, ff, clip = cfg.hidden_size, cfg.intermediate_size, cfg.clipped_linears
        self.gate_proj = ClippableLinear(h, ff, clip)
        self.up_proj = ClippableLinear(h, ff, clip)
        self.down_proj = ClippableLinear(ff, h, clip)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma4VisionLayer(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Gemma4VisionAttention(cfg)
        self.mlp = Gemma4VisionMLP(cfg)
        self.input_layernorm = Gemma4RMSNorm(h, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(h, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(h, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(h, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class PatchEmbedder(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.input_proj = Linear(cfg.patch_dim, cfg.hidden_size)
        table = torch.zeros(2, cfg.position_table_size, cfg.hidden_size)
        self.position_embedding_table = nn.Parameter(table, requires_grad=False)

    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.input_proj(2 * (patches - 0.5))
        table = self.position_embedding_table
        return x + (table[0][positions[:, 0]] + table[1][positions[:, 1]])


class VisionEncoder(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Gemma4VisionLayer(cfg) for _ in range(cfg.num_layers))


class Gemma4VisionTower(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch_embedder = PatchEmbedder(cfg)
        self.encoder = VisionEncoder(cfg)
        if cfg.standardize:
            self.std_bias = nn.Parameter(torch.zeros(cfg.hidden_size), requires_grad=False)
            self.std_scale = nn.Parameter(torch.ones(cfg.hidden_size), requires_grad=False)

    def rotation(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [n, 2, head_dim / 2] of each patch's x and y."""
        quarter = self.config.head_dim // 2
        exponents = torch.arange(0, quarter, 2, dtype=torch.float32) / quarter
        inv = 1.0 / self.config.rope_theta**exponents
        angles = positions[..., None].float() * inv  # [n, 2, head_dim / 4]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One image's patches [n, 3 * patch^2] in [0, 1] and their (x, y) [n, 2] -> its
        soft tokens [n / pooling^2, hidden] in float32 (before the projection)."""
        cfg = self.config
        dtype = self.patch_embedder.input_proj.weight.dtype
        x = self.patch_embedder(patches.to(dtype), positions)
        cos, sin = (t.to(dtype) for t in self.rotation(positions))
        for layer in self.encoder.layers:
            x = layer(x, cos, sin)
        k = cfg.pooling
        width = int(positions[:, 0].max()) + 1
        cell = positions[:, 0] // k + (width // k) * (positions[:, 1] // k)
        pooled = torch.zeros(x.shape[0] // k**2, x.shape[1], dtype=torch.float32)
        pooled.index_add_(0, cell, x.float() / k**2)
        pooled = pooled * cfg.hidden_size**0.5
        if cfg.standardize:
            pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
        return pooled


class MultimodalEmbedder(nn.Module):
    """An encoder's tokens into the text model: a weightless RMS norm, then a projection."""

    def __init__(self, width: int, text_hidden: int, eps: float) -> None:
        super().__init__()
        self.embedding_projection = Linear(width, text_hidden)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(unit_rms(x, self.eps))
