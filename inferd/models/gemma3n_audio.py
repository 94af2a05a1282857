"""Gemma 3n's audio encoder (transformers' Gemma3nAudioEncoder, a Universal Speech Model
conformer), module for module under its checkpoint names.

A clip's log-mel frames [frames, mel bins] go through:

- two conv blocks (``subsample_conv_projection``): each pads the frequency axis by one bin on
  both sides and the time axis by ``kernel - 1`` frames after the clip, convolves with its
  stride, normalizes with a cumulative group norm (each time step by the mean and variance of
  all values up to it) and applies ReLU; the output is flattened per time step (frequency,
  then channel) and projected to the encoder's width;
- conformer layers: a half-weighted feed-forward, local self-attention, a light causal conv
  and a second half-weighted feed-forward, each clamped to ``gradient_clipping`` around its
  ``w``-scaled RMS norms, the layer's output normed once more;
- every ``reduction``-th row of the result (one row per 160 ms with the real settings).

The attention: each row sees ``context_left - 1`` rows back and ``context_right`` ahead (itself
included), as transformers masks them. Queries are scaled per channel
(``softplus(per_dim_scale)``, with ``head_dim ** -0.5 / ln 2``); a key ``d`` rows away adds the
query's product with a projected sinusoid of ``d`` (Transformer-XL relative positions, ``d``
from ``context_left - 1`` back to ``-context_right``); logits are soft-capped. transformers
computes this over blocks of ``chunk_size`` queries and their context, and its relative shift
pairs each query and key with the sinusoid of their distance wherever the mask lets the key
be seen; every such key lies in the block's context, so the same band over the whole clip
gives the same logits. A lone clip has no padded frames, so nothing else is masked.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from inferd.layers.linear import Linear
from inferd.models.config import Gemma3nAudioConfig
from inferd.models.gemma4 import Gemma4RMSNorm

DEFAULT_EPS = 1e-6  # the norms transformers builds without the config's eps


def _clamp(x: torch.Tensor, bound: float) -> torch.Tensor:
    bound = min(bound, torch.finfo(x.dtype).max)
    return torch.clamp(x, -bound, bound)


class CumulativeGroupNorm(nn.Module):
    """Each time step of [1, T, F, C] normalized by the mean and variance of every value up to
    it (all frequencies and channels; each step's squared deviations taken from its own running
    mean), then scaled per channel; in float32."""

    def __init__(self, channels: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        per_step = x32.shape[2] * x32.shape[3]
        count = torch.arange(1, x32.shape[1] + 1, dtype=torch.float32).view(1, -1, 1, 1)
        count = count * per_step
        mean = torch.cumsum(x32.sum(dim=(2, 3), keepdim=True), dim=1) / count
        deviations = (x32 - mean).pow(2).sum(dim=(2, 3), keepdim=True)
        variance = torch.cumsum(deviations, dim=1) / count
        out = (x32 - mean) * torch.rsqrt(variance + self.eps) * self.weight.float()
        return out.to(x.dtype)


class SubsampleBlock(nn.Module):
    def __init__(
        self,
        cfg: Gemma3nAudioConfig,
        in_channels: int,
        out_channels: int,
        kernel: tuple[int, int],
        stride: tuple[int, int],
    ) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel, stride=stride, bias=False)
        self.norm = CumulativeGroupNorm(out_channels, cfg.group_norm_eps)
        # (frequency before, after, time before, after): the clip's frames see the ones after
        self.padding = (1, 1, 0, kernel[0] - 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[1, C, T, F] -> [1, C', ceil(T / stride), F']."""
        x = self.conv(F.pad(x, self.padding).to(self.conv.weight.dtype))
        return F.relu(self.norm(x.permute(0, 2, 3, 1))).permute(0, 3, 1, 2)


class SubsampleConvProjection(nn.Module):
    def __init__(self, cfg: Gemma3nAudioConfig) -> None:
        super().__init__()
        channels, bins = (1, *cfg.conv_channels), cfg.mel_bins
        blocks = []
        for i, (kernel, stride) in enumerate(zip(cfg.conv_kernels, cfg.conv_strides, strict=True)):
            blocks.append(SubsampleBlock(cfg, channels[i], channels[i + 1], kernel, stride))
            bins = (bins + 2 - kernel[1]) // stride[1] + 1
        self.conv_0, self.conv_1 = blocks
        self.input_proj_linear = Linear(bins * cfg.conv_channels[1], cfg.hidden_size)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[frames, mel bins] -> [rows, hidden]."""
        x = self.conv_1(self.conv_0(features[None, None]))
        return self.input_proj_linear(x[0].permute(1, 2, 0).flatten(1))


class FeedForward(nn.Module):
    def __init__(self, cfg: Gemma3nAudioConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.pre_layer_norm = Gemma4RMSNorm(h, DEFAULT_EPS)
        self.ffw_layer_1 = Linear(h, 4 * h)
        self.ffw_layer_2 = Linear(4 * h, h)
        self.post_layer_norm = Gemma4RMSNorm(h, DEFAULT_EPS)
        self.clip, self.weight = cfg.gradient_clipping, cfg.residual_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre_layer_norm(_clamp(x, self.clip))
        h = self.ffw_layer_2(F.silu(self.ffw_layer_1(h)))
        return x + self.post_layer_norm(_clamp(h, self.clip)) * self.weight


class RelativePositions(nn.Module):
    """The sinusoid of each distance a key may lie from its query, projected per head."""

    def __init__(self, cfg: Gemma3nAudioConfig) -> None:
        super().__init__()
        self.pos_proj = Linear(cfg.hidden_size, cfg.hidden_size)
        self.back, self.ahead = max(0, cfg.context_left - 1), cfg.context_right
        self.timescales = cfg.hidden_size // 2

    def forward(self, dtype: torch.dtype) -> torch.Tensor:
        """[back + ahead + 1, hidden]: row r for the distance ``back - r`` (query after key)."""
        step = math.log(1.0e4) / max(self.timescales - 1, 1)
        inv_timescales = torch.exp(torch.arange(self.timescales) * -step).float()
        distance = torch.arange(self.back, -self.ahead - 1, -1).float()[:, None]
        scaled = distance * inv_timescales[None, :]
        signal = torch.cat((torch.sin(scaled), torch.cos(scaled)), dim=-1).to(dtype)
        return self.pos_proj(signal)


class LocalAttention(nn.Module):
    def __init__(self, cfg: Gemma3nAudioConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.heads, self.head_dim = cfg.num_heads, h // cfg.num_heads
        self.relative_position_embedding = RelativePositions(cfg)
        self.per_dim_scale = nn.Parameter(torch.zeros(self.head_dim), requires_grad=False)
        self.q_proj = Linear(h, h)
        self.k_proj = Linear(h, h)
        self.v_proj = Linear(h, h)
        self.q_scale = self.head_dim**-0.5 / math.log(2.0)  # over softplus(0)
        self.logit_cap = cfg.logit_cap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        shape = (t, self.heads, self.head_dim)
        q = self.q_proj(x).view(shape) * self.q_scale * F.softplus(self.per_dim_scale)
        k = self.k_proj(x).view(shape)
        v = self.v_proj(x).view(shape)
        logits = torch.einsum("ihd,jhd->hij", q, k)
        rel = self.relative_position_embedding(x.dtype).view(-1, self.heads, self.head_dim)
        bias = torch.einsum("ihd,rhd->hir", q, rel)  # [heads, T, distances]
        back = self.relative_position_embedding.back
        distance = torch.arange(t)[:, None] - torch.arange(t)[None, :]
        row = back - distance  # the table's row of each (query, key); outside it: not seen
        visible = (row >= 0) & (row < rel.shape[0])
        index = row.clamp(0, rel.shape[0] - 1)[None].expand(self.heads, t, t)
        logits = logits + torch.where(visible, bias.gather(2, index), 0.0)
        logits = torch.tanh(logits / self.logit_cap) * self.logit_cap
        logits = logits.masked_fill(~visible, torch.finfo(logits.dtype).min)
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32).to(v.dtype)
        return torch.einsum("hij,jhd->ihd", weights, v).reshape(t, -1)


class ConformerAttention(nn.Module):
    def __init__(self, cfg: Gemma3nAudioConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.pre_attn_norm = Gemma4RMSNorm(h, DEFAULT_EPS)
        self.attn = LocalAttention(cfg)
        self.post = Linear(h, h)
        self.post_norm = Gemma4RMSNorm(h, DEFAULT_EPS)
        self.clip = cfg.gradient_clipping

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn(self.pre_attn_norm(_clamp(x, self.clip)))
        return x + self.post_norm(_clamp(self.post(h), self.clip))


class LightConv1d(nn.Module):
    def __init__(self, cfg: Gemma3nAudioConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.pre_layer_norm = Gemma4RMSNorm(h, eps)
        self.linear_start = Linear(h, 2 * h)
        self.depthwise_conv1d = nn.Conv1d(h, h, cfg.lconv_kernel_size, groups=h, bias=False)
        self.conv_norm = Gemma4RMSNorm(h, eps)
        self.linear_end = Linear(h, h)
        self.clip = cfg.gradient_clipping

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.glu(self.linear_start(self.pre_layer_norm(x)), dim=-1)  # [T, H]
        causal = F.pad(h.T[None], (self.depthwise_conv1d.kernel_size[0] - 1, 0))
        h = _clamp(self.depthwise_conv1d(causal)[0].T, self.clip)
        return x + self.linear_end(F.silu(self.conv_norm(h)))


class ConformerBlock(nn.Module):
    def __init__(self, cfg: Gemma3nAudioConfig) -> None:
        super().__init__()
        self.ffw_layer_start = FeedForward(cfg)
        self.attention = ConformerAttention(cfg)
        self.lconv1d = LightConv1d(cfg)
        self.ffw_layer_end = FeedForward(cfg)
        self.norm = Gemma4RMSNorm(cfg.hidden_size, DEFAULT_EPS)
        self.clip = cfg.gradient_clipping

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lconv1d(self.attention(self.ffw_layer_start(x)))
        return self.norm(_clamp(self.ffw_layer_end(x), self.clip))


class Gemma3nAudioEncoder(nn.Module):
    def __init__(self, cfg: Gemma3nAudioConfig) -> None:
        super().__init__()
        self.subsample_conv_projection = SubsampleConvProjection(cfg)
        self.conformer = nn.ModuleList(ConformerBlock(cfg) for _ in range(cfg.num_layers))
        self.reduction = cfg.reduction

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """One clip's log-mel frames [frames, mel bins] -> its rows [``num_rows``, hidden]."""
        dtype = self.subsample_conv_projection.input_proj_linear.weight.dtype
        x = self.subsample_conv_projection(features.to(dtype))
        for block in self.conformer:
            x = block(x)
        return x[:: self.reduction]
