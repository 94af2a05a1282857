"""Gemma 3n's image encoder: MobileNet-v5 (timm's ``mobilenetv5_300m_enc``, which
transformers' Gemma3nForConditionalGeneration builds through timm), module for module under
timm's names so the checkpoint's ``model.vision_tower.timm_model.*`` tensors load one to one.

The network, NCHW throughout, every norm an RMS norm over the channels (no mean, eps 1e-6),
every activation tanh-approximated GELU, every convolution padded "same" as TensorFlow does
(for a stride of 2 the odd pixel of padding goes after):

- a stem: a 3x3 convolution with a bias at stride 2, normed and activated;
- four stages of blocks (``MOBILENET_V5_300M``), each opening at stride 2:
  - edge residual (``er``): a full 3x3 expanding convolution, norm, GELU, a 1x1 projection,
    norm (FusedMBConv);
  - universal inverted residual (``uir``): an optional depthwise convolution (``start``, no
    activation), a 1x1 expansion (norm, GELU), an optional depthwise convolution (``kernel``,
    norm, GELU, carrying the stride), a 1x1 projection (norm), then a per-channel layer scale;
  - mobile multi-query attention (``mqa``): a norm, then attention of ``heads`` query heads
    over one shared key and value head (1x1 projections), whose keys and values may first be
    downsampled by a strided depthwise convolution and a norm (``kv_stride``); a 1x1 output
    projection and a layer scale;
  each adds its input back where the shape allows (stride 1, same channels);
- the multi-scale fusion adapter (MSFA): the last two stages' outputs, the smaller upsampled
  (nearest) to the larger, concatenated, through an inverted-residual FFN (no skip, no layer
  scale) to ``hidden_size`` channels, average-pooled to ``output_resolution`` squared (bilinear
  when the grids do not divide) and normed.

Every stage's width is scaled by ``channel_multiplier`` (timm's ``round_channels``: to a
multiple of 8, at least 8); below 1 the stem keeps its 64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from inferd.models.config import Gemma3nVisionConfig, ModelConfigError

NORM_EPS = 1e-6  # timm's RmsNorm2d default; the vision config's rms_norm_eps is embed_vision's
STEM_CHANNELS = 64


@dataclass(frozen=True, slots=True)
class BlockSpec:
    """One block of the architecture: timm's block string (``uir_r1_a5_k5_s2_e6_c640``)."""

    kind: str  # er | uir | mqa
    channels: int  # c: output channels before the multiplier
    stride: int = 1  # s
    kernel: int = 0  # k: er's expansion, uir's middle depthwise, mqa's K/V downsampling
    start: int = 0  # a: uir's first depthwise kernel (0: none)
    expansion: float = 1.0  # e
    heads: int = 0  # h (mqa)
    key_dim: int = 0  # d (mqa: keys and values alike)
    kv_stride: int = 1  # v (mqa)


def _er(stride: int) -> BlockSpec:
    return BlockSpec("er", 128, stride, kernel=3, expansion=4)


def _uir(channels: int, start: int, kernel: int, expansion: float, stride: int = 1) -> BlockSpec:
    return BlockSpec("uir", channels, stride, kernel, start, expansion)


def _attention_pairs(
    channels: int, heads: int, key_dim: int, kv_stride: int, n: int
) -> list[BlockSpec]:
    mqa = BlockSpec("mqa", channels, kernel=3, heads=heads, key_dim=key_dim, kv_stride=kv_stride)
    return [block for _ in range(n) for block in (mqa, _uir(channels, 0, 0, 2))]


# timm's mobilenetv5_300m_enc (the encoder of every published Gemma 3n).
MOBILENET_V5_300M: tuple[tuple[BlockSpec, ...], ...] = (
    (_er(2), _er(1), _er(1)),
    (
        _uir(256, 3, 5, 6, stride=2),
        *(_uir(256, start, 0, 4) for start in (5, 3, 5, 3)),
    ),
    (
        _uir(640, 5, 5, 6, stride=2),
        *(_uir(640, 5, 0, 4) for _ in range(7)),
        _uir(640, 0, 0, 1),
        *_attention_pairs(640, heads=12, key_dim=64, kv_stride=2, n=14),
    ),
    (
        _uir(1280, 5, 5, 6, stride=2),
        *_attention_pairs(1280, heads=16, key_dim=96, kv_stride=1, n=19),
    ),
)
FUSED_STAGES = (2, 3)  # the MSFA's inputs (timm's msfa_indices -2, -1)


def make_divisible(value: float, divisor: int = 8) -> int:
    """timm's channel rounding: the nearest multiple of ``divisor`` (at least ``divisor``),
    one more step up where rounding down lost over 10%."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TensorFlow's "same" padding of one axis: (before, after)."""
    total = max((math.ceil(size / stride) - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


class SameConv2d(nn.Conv2d):
    """A convolution padded "same" for the input's own size (timm's ``pad_type='same'``)."""

    def __init__(
        self, cin: int, cout: int, kernel: int, stride: int = 1, *, depthwise: bool = False
    ) -> None:
        super().__init__(cin, cout, kernel, stride, groups=cin if depthwise else 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, s = self.kernel_size[0], self.stride[0]
        top, bottom = same_padding(x.shape[-2], k, s)
        left, right = same_padding(x.shape[-1], k, s)
        if top or bottom or left or right:
            x = F.pad(x, (left, right, top, bottom))
        return self._conv_forward(x, self.weight, self.bias)


class RMSNorm2d(nn.Module):
    """RMS norm over the channels of NCHW, in float32, times a per-channel weight."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(1, keepdim=True) + NORM_EPS)
        return (x32 * self.weight.float().view(1, -1, 1, 1)).to(x.dtype)


def gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class ConvNorm(nn.Module):
    """Convolution, norm and (with ``act``) GELU: timm's ConvNormAct."""

    def __init__(
        self,
        cin: int,
        cout: int,
        kernel: int,
        stride: int = 1,
        *,
        act: bool = True,
        depthwise: bool = False,
    ) -> None:
        super().__init__()
        self.conv = SameConv2d(cin, cout, kernel, stride, depthwise=depthwise)
        self.bn = RMSNorm2d(cout)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn(self.conv(x))
        return gelu(x) if self.act else x


class LayerScale2d(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(channels), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma.view(1, -1, 1, 1).to(x.dtype)


class EdgeResidual(nn.Module):
    def __init__(self, cin: int, cout: int, spec: BlockSpec) -> None:
        super().__init__()
        mid = make_divisible(cin * spec.expansion)
        self.conv_exp = SameConv2d(cin, mid, spec.kernel, spec.stride)
        self.bn1 = RMSNorm2d(mid)
        self.conv_pwl = SameConv2d(mid, cout, 1)
        self.bn2 = RMSNorm2d(cout)
        self.skip = spec.stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn2(self.conv_pwl(gelu(self.bn1(self.conv_exp(x)))))
        return x + y if self.skip else y


class UniversalInvertedResidual(nn.Module):
    def __init__(
        self, cin: int, cout: int, spec: BlockSpec, *, skip: bool = True, scale: bool = True
    ) -> None:
        super().__init__()
        mid = make_divisible(cin * spec.expansion)
        # the stride goes to the middle depthwise convolution where there is one
        start_stride = 1 if spec.kernel else spec.stride
        self.dw_start: nn.Module = (
            ConvNorm(cin, cin, spec.start, start_stride, act=False, depthwise=True)
            if spec.start
            else nn.Identity()
        )
        self.pw_exp = ConvNorm(cin, mid, 1)
        self.dw_mid: nn.Module = (
            ConvNorm(mid, mid, spec.kernel, spec.stride, depthwise=True)
            if spec.kernel
            else nn.Identity()
        )
        self.pw_proj = ConvNorm(mid, cout, 1, act=False)
        self.layer_scale: nn.Module = LayerScale2d(cout) if scale else nn.Identity()
        self.skip = skip and spec.stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pw_proj(self.dw_mid(self.pw_exp(self.dw_start(x))))
        y = self.layer_scale(y)
        return x + y if self.skip else y


class Projection(nn.Module):
    """A 1x1 projection, after a strided depthwise convolution and a norm with ``stride``."""

    def __init__(self, cin: int, cout: int, kernel: int = 0, stride: int = 1) -> None:
        super().__init__()
        down = stride > 1
        self.down_conv = (
            SameConv2d(cin, cin, kernel, stride, depthwise=True) if down else nn.Identity()
        )
        self.norm = RMSNorm2d(cin) if down else nn.Identity()
        self.proj = SameConv2d(cin, cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(self.down_conv(x)))


class MultiQueryAttention2d(nn.Module):
    """``heads`` query heads at every pixel over one key/value head at every (downsampled)
    pixel, scaled by ``1/sqrt(key_dim)``."""

    def __init__(self, channels: int, cout: int, spec: BlockSpec) -> None:
        super().__init__()
        self.heads, self.key_dim = spec.heads, spec.key_dim
        self.query = Projection(channels, spec.heads * spec.key_dim)
        self.key = Projection(channels, spec.key_dim, spec.kernel, spec.kv_stride)
        self.value = Projection(channels, spec.key_dim, spec.kernel, spec.kv_stride)
        self.output = Projection(spec.heads * spec.key_dim, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, h, w = x.shape
        q = self.query(x).reshape(b, self.heads, self.key_dim, h * w).transpose(-1, -2)
        k = self.key(x).flatten(2).transpose(1, 2).unsqueeze(1)  # [b, 1, pixels, key_dim]
        v = self.value(x).flatten(2).transpose(1, 2).unsqueeze(1)
        o = F.scaled_dot_product_attention(q, k, v)  # [b, heads, h * w, key_dim]
        o = o.transpose(1, 2).reshape(b, h, w, self.heads * self.key_dim).permute(0, 3, 1, 2)
        return self.output(o)


class MobileAttention(nn.Module):
    def __init__(self, cin: int, cout: int, spec: BlockSpec) -> None:
        super().__init__()
        self.norm = RMSNorm2d(cin)
        self.attn = MultiQueryAttention2d(cin, cout, spec)
        self.layer_scale = LayerScale2d(cout)
        self.skip = spec.stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layer_scale(self.attn(self.norm(x)))
        return x + y if self.skip else y


def make_block(cin: int, cout: int, spec: BlockSpec) -> nn.Module:
    if spec.kind == "er":
        return EdgeResidual(cin, cout, spec)
    if spec.kind == "uir":
        return UniversalInvertedResidual(cin, cout, spec)
    return MobileAttention(cin, cout, spec)


class MultiScaleFusionAdapter(nn.Module):
    def __init__(self, cin: int, cout: int, resolution: int) -> None:
        super().__init__()
        ffn = BlockSpec("uir", cout, expansion=2)
        self.ffn = UniversalInvertedResidual(cin, cout, ffn, skip=False, scale=False)
        self.norm = RMSNorm2d(cout)
        self.resolution = resolution

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        size = features[0].shape[-2:]  # the first is the finest
        resized = [
            f if f.shape[-2:] == size else F.interpolate(f, size=size, mode="nearest")
            for f in features
        ]
        x = self.ffn(torch.cat(resized, dim=1))
        r = self.resolution
        if size != (r, r):
            if size[0] % r or size[1] % r:
                x = F.interpolate(x, size=(r, r), mode="bilinear")
            else:
                stride = (size[0] // r, size[1] // r)
                x = F.avg_pool2d(x, kernel_size=stride, stride=stride)
        return self.norm(x)


class MobileNetV5Encoder(nn.Module):
    """Images [n, 3, S, S] -> fused features [n, hidden_size, r, r]."""

    def __init__(self, cfg: Gemma3nVisionConfig) -> None:
        super().__init__()
        m = cfg.channel_multiplier
        stem = STEM_CHANNELS if m < 1 else make_divisible(STEM_CHANNELS * m)
        self.conv_stem = ConvNorm(3, stem, 3, stride=2)
        self.conv_stem.conv.bias = nn.Parameter(torch.zeros(stem), requires_grad=False)
        cin, stages, fused = stem, [], 0
        for i, specs in enumerate(MOBILENET_V5_300M):
            blocks = []
            for spec in specs:
                cout = make_divisible(spec.channels * m)
                blocks.append(make_block(cin, cout, spec))
                cin = cout
            stages.append(nn.Sequential(*blocks))
            fused += cin if i in FUSED_STAGES else 0
        self.blocks = nn.ModuleList(stages)
        self.msfa = MultiScaleFusionAdapter(fused, cfg.hidden_size, cfg.output_resolution)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.conv_stem(pixels)
        features = []
        for i, stage in enumerate(self.blocks):
            x = stage(x)
            if i in FUSED_STAGES:
                features.append(x)
        return self.msfa(features)


class Gemma3nVisionTower(nn.Module):
    """transformers' TimmWrapperModel around the encoder: the name ``timm_model`` is the
    checkpoint's. ``forward`` gives each image's soft-token rows [n, r * r, hidden], row-major
    over the grid, scaled by ``sqrt(hidden)`` as Gemma3nModel does before ``embed_vision``."""

    def __init__(self, cfg: Gemma3nVisionConfig) -> None:
        super().__init__()
        # checked here, not with the config: a checkpoint without the tower keeps whatever
        # vision_config transformers wrote beside it
        if cfg.soft_tokens != cfg.output_resolution**2:
            raise ModelConfigError(
                f"gemma3n's {cfg.soft_tokens} vision soft tokens are not the encoder's "
                f"{cfg.output_resolution}x{cfg.output_resolution} grid"
            )
        self.timm_model = MobileNetV5Encoder(cfg)
        self.scale = cfg.hidden_size**0.5

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        features = self.timm_model(pixels)
        return features.flatten(2).transpose(1, 2) * self.scale
