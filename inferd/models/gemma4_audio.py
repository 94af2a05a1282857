"""Gemma 4's audio encoder (a Universal Speech Model conformer) and its projection.

A clip's log-mel frames [frames, mel bins] go through:

- two conv blocks (3x3, stride 2 in time and frequency, a channel LayerNorm, ReLU), whose
  output is flattened per time step and projected to the encoder's width: one row per 4
  frames (40 ms);
- conformer layers: a half-weighted feed-forward, local self-attention, a light causal conv
  and a second half-weighted feed-forward, each around its own norms (``w``-scaled RMS);
- an output projection (with bias), then the weightless RMS norm and projection into the
  text model (models/gemma4_vision.py's ``MultimodalEmbedder``).

The attention: each row sees ``context_left - 1`` rows back (itself included) and
``context_right - 1`` ahead, as transformers masks them. Queries are scaled per channel
(``softplus(per_dim_scale)``, with ``head_dim ** -0.5 / ln 2``), keys by
``ln(1 + e) / ln 2``; a key ``d`` rows back adds the query's product with a projected
sinusoid of ``d`` (Transformer-XL relative positions; keys ahead add nothing); logits are
soft-capped. transformers computes this over fixed chunks of ``chunk_size`` queries with
their context; each key a query may see lies inside its chunk's context, so the same band
over the whole clip gives the same logits.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from inferd.layers.linear import Linear
from inferd.models.config import Gemma4AudioConfig
from inferd.models.gemma4 import Gemma4RMSNorm
from inferd.models.gemma4_vision import ClippableLinear


class SubsampleBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, eps: float) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, stride=2, padding=1, bias=False)
        self.norm = nn.LayerNorm(out_channels, eps=eps, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[1, C, T, F] -> [1, C', ceil(T / 2), ceil(F / 2)]."""
        x = self.conv(x)
        return F.relu(self.norm(x.permute(0, 2, 3, 1))).permute(0, 3, 1, 2)


class SubsampleProjection(nn.Module):
    def __init__(self, cfg: Gemma4AudioConfig) -> None:
        super().__init__()
        first, second = cfg.conv_channels
        self.layer0 = SubsampleBlock(1, first, cfg.rms_norm_eps)
        self.layer1 = SubsampleBlock(first, second, cfg.rms_norm_eps)
        # The frequency axis (as many mel bins as the first block has channels) is quartered.
        self.input_proj_linear = Linear((first // 4) * second, cfg.hidden_size)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.layer1(self.layer0(features[None, None]))
        return self.input_proj_linear(x[0].permute(1, 2, 0).flatten(1))


class FeedForward(nn.Module):
    def __init__(self, cfg: Gemma4AudioConfig) -> None:
        super().__init__()
        h, clip = cfg.hidden_size, cfg.clipped_linears
        self.ffw_layer_1 = ClippableLinear(h, 4 * h, clip)
        self.ffw_layer_2 = ClippableLinear(4 * h, h, clip)
        self.pre_layer_norm = Gemma4RMSNorm(h, 1e-6)  # transformers keeps the default eps here
        self.post_layer_norm = Gemma4RMSNorm(h, 1e-6)
        self.clip, self.weight = cfg.gradient_clipping, cfg.residual_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        clip = min(self.clip, torch.finfo(x.dtype).max)
        h = self.pre_layer_norm(torch.clamp(x, -clip, clip))
        h = self.ffw_layer_2(F.silu(self.ffw_layer_1(h)))
        return x + self.post_layer_norm(torch.clamp(h, -clip, clip)) * self.weight


class LightConv(nn.Module):
    def __init__(self, cfg: Gemma4AudioConfig) -> None:
        super().__init__()
        h, clip, eps = cfg.hidden_size, cfg.clipped_linears, cfg.rms_norm_eps
        self.linear_start = ClippableLinear(h, 2 * h, clip)
        self.linear_end = ClippableLinear(h, h, clip)
        self.depthwise_conv1d = nn.Conv1d(h, h, cfg.conv_kernel_size, groups=h, bias=False)
        self.pre_layer_norm = Gemma4RMSNorm(h, eps)
        self.conv_norm = Gemma4RMSNorm(h, eps)
        self.clip = cfg.gradient_clipping

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.glu(self.linear_start(self.pre_layer_norm(x)), dim=-1)  # [T, H]
        causal = F.pad(h.T[None], (self.depthwise_conv1d.kernel_size[0] - 1, 0))
        h = self.depthwise_conv1d(causal)[0].T
        clip = min(self.clip, torch.finfo(h.dtype).max)
        h = F.silu(self.conv_norm(torch.clamp(h, -clip, clip)))
        return x + self.linear_end(h)


class LocalAttention(nn.Module):
    def __init__(self, cfg: Gemma4AudioConfig) -> None:
        super().__init__()
        h, clip = cfg.hidden_size, cfg.clipped_linears
        self.heads, self.head_dim = cfg.num_heads, h // cfg.num_heads
        self.q_proj = ClippableLinear(h, h, clip)
        self.k_proj = ClippableLinear(h, h, clip)
        self.v_proj = ClippableLinear(h, h, clip)
        self.post = ClippableLinear(h, h, clip)
        self.relative_k_proj = Linear(h, h)
        self.per_dim_scale = nn.Parameter(torch.zeros(self.head_dim), requires_grad=False)
        self.cfg = cfg

    def relative_positions(self, dtype: torch.dtype) -> torch.Tensor:
        """The sinusoids [rows, hidden] transformers projects into relative keys: row r
        stands for position ``context // 2 - r``, the last for 0."""
        cfg = self.cfg
        context = cfg.chunk_size + cfg.context_left - 1 + cfg.context_right
        half = cfg.hidden_size // 2
        step = math.log(10000.0) / max(half - 1, 1)
        inv = torch.exp(torch.arange(half) * -step)
        positions = torch.arange(context // 2, -1, -1)[:, None] * inv[None, :]
        return torch.cat((positions.sin(), positions.cos()), dim=-1).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg, t = self.cfg, x.shape[0]
        shape = (t, self.heads, self.head_dim)
        q_scale = (self.head_dim**-0.5) / math.log(2)
        q = self.q_proj(x).float().view(shape) * q_scale * F.softplus(self.per_dim_scale)
        k = self.k_proj(x).float().view(shape) * (math.log(1 + math.e) / math.log(2))
        v = self.v_proj(x).float().view(shape)
        rel = self.relative_k_proj(self.relative_positions(x.dtype)).float()
        rel = rel.view(-1, self.heads, self.head_dim)  # [P, heads, head_dim]
        logits = torch.einsum("ihd,jhd->hij", q, k)
        # transformers' blocked layout pairs row r of ``rel`` with the key ``left - 1 - r``
        # rows back (keys ahead, past the table, add nothing).
        distance = torch.arange(t)[:, None] - torch.arange(t)[None, :]
        r = cfg.context_left - 1 - distance
        bias = torch.einsum("ihd,phd->hip", q, rel)  # [heads, T, P]
        known = (r >= 0) & (r < rel.shape[0])
        gathered = bias.gather(2, r.clamp(0, rel.shape[0] - 1)[None].expand(self.heads, t, t))
        logits = logits + torch.where(known, gathered, 0.0)
        logits = torch.tanh(logits / cfg.logit_cap) * cfg.logit_cap
        visible = (distance >= 0) & (distance < cfg.context_left - 1)
        visible |= (distance < 0) & (-distance < cfg.context_right)
        logits = logits.masked_fill(~visible, cfg.invalid_logit)
        weights = torch.softmax(logits, dim=-1)
        out = torch.einsum("hij,jhd->ihd", weights, v).reshape(t, -1)
        return self.post(out.to(x.dtype))


class ConformerLayer(nn.Module):
    def __init__(self, cfg: Gemma4AudioConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.feed_forward1 = FeedForward(cfg)
        self.feed_forward2 = FeedForward(cfg)
        self.self_attn = LocalAttention(cfg)
        self.lconv1d = LightConv(cfg)
        self.norm_pre_attn = Gemma4RMSNorm(h, 1e-6)
        self.norm_post_attn = Gemma4RMSNorm(h, 1e-6)
        self.norm_out = Gemma4RMSNorm(h, 1e-6)
        self.clip = cfg.gradient_clipping

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        clip = min(self.clip, torch.finfo(self.norm_pre_attn.weight.dtype).max)
        x = self.feed_forward1(x)
        h = self.self_attn(self.norm_pre_attn(torch.clamp(x, -clip, clip)))
        x = x + self.norm_post_attn(torch.clamp(h, -clip, clip))
        x = self.feed_forward2(self.lconv1d(x))
        return self.norm_out(torch.clamp(x, -clip, clip))


class Gemma4AudioTower(nn.Module):
    def __init__(self, cfg: Gemma4AudioConfig) -> None:
        super().__init__()
        self.subsample_conv_projection = SubsampleProjection(cfg)
        self.layers = nn.ModuleList(ConformerLayer(cfg) for _ in range(cfg.num_layers))
        self.output_proj = Linear(cfg.hidden_size, cfg.output_dims, bias=True)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """One clip's log-mel frames [frames, mel bins] -> [ceil(frames / 4), output dims]."""
        dtype = self.output_proj.weight.dtype
        x = self.subsample_conv_projection(features.to(dtype))
        for layer in self.layers:
            x = layer(x)
        return self.output_proj(x)
