"""Qwen2.5-VL: a vision encoder for images and videos, and the Qwen2 decoder of
models/llama.py turned by M-RoPE.

The encoder takes flat patches ``[n, C * T * P * P]`` (models/qwen2_vl_image.py makes them:
``T`` frames per temporal patch, an image repeated to fill them) with each input's grid
``(t, h, w)`` in patches. Its 3D patch embedding is a convolution whose kernel is the patch,
so here one matmul. Its blocks (RMSNorm, attention with a 2D rotary over each patch's row and
column, RMSNorm, SwiGLU with biases) attend within windows of ``window_size`` pixels, except the
``fullatt_block_indexes`` blocks, which attend over a whole frame; the patches are reordered
window by window (in units of the 2x2 merge group) so a window is a contiguous run, and the
merger (RMSNorm, then an MLP over each 2x2 group) gives one row per ``<|image_pad|>`` or
``<|video_pad|>`` token, put back in raster order.

M-RoPE: each token has three positions (temporal, height, width); the rotary pairs are split
into ``mrope_section`` runs, run ``i`` turned by position ``i % 3``. Text tokens have three equal
positions; an image's or video's tokens have their grid coordinates offset by the position
where the media starts (a video's temporal coordinate scaled by its seconds per temporal patch
times ``tokens_per_second``), and the text after it continues from their largest position + 1.
``rope_index`` computes a prompt's positions; the engine's runner carries them and, for the
tokens past the prompt, uses ``position + delta``. Submodule names follow the checkpoints'
(``visual.blocks.N.attn.qkv``, ``visual.merger.mlp.0``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from inferd.kernels.ops import Rotation
from inferd.layers.rotary import RotaryEmbedding
from inferd.models.config import ModelConfig, ModelConfigError, QwenVisionConfig
from inferd.models.llama import LlamaForCausalLM

Grid = tuple[int, int, int]  # (t, h, w) in patches


class VisionRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(
            cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel, bias=False
        )

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # The kernel covers the whole patch: the convolution is one matmul over its values.
        return F.linear(patches, self.proj.weight.flatten(1))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: Segments
    ) -> torch.Tensor:
        """x [n, d]; cos, sin [n, head_dim] float32; groups: the runs that attend within."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        c, s = cos[:, None], sin[:, None]
        # Rotated in float32, as the reference does, then back to the model dtype.
        q = (q.float() * c + rotate_half(q.float()) * s).to(x.dtype)
        k = (k.float() * c + rotate_half(k.float()) * s).to(x.dtype)
        out = torch.empty_like(q)
        for rows in groups.batches:  # [runs, length]: runs of one length, batched

            def part(t: torch.Tensor, rows: torch.Tensor = rows) -> torch.Tensor:
                return t[rows].transpose(1, 2)  # [runs, heads, length, head_dim]

            out[rows] = F.scaled_dot_product_attention(part(q), part(k), part(v)).transpose(1, 2)
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.norm1 = VisionRMSNorm(cfg.hidden_size)
        self.norm2 = VisionRMSNorm(cfg.hidden_size)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: Segments
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, groups)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = VisionRMSNorm(cfg.hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, cfg.out_hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


@dataclass(frozen=True, slots=True)
class Segments:
    """Consecutive runs of rows that attend among themselves (a frame, or a window), as row
    indices grouped by run length: one batched attention call per length instead of a mask
    over all rows (windows are a few dozen patches; a frame may be thousands)."""

    batches: tuple[torch.Tensor, ...]  # each [runs, length] of row indices

    @classmethod
    def of(cls, ids: torch.Tensor) -> Segments:
        """From each row's run id (runs consecutive)."""
        _, lengths = torch.unique_consecutive(ids, return_counts=True)
        starts = torch.cumsum(lengths, 0) - lengths
        batches = []
        for length in lengths.unique().tolist():
            first = starts[lengths == length]
            batches.append(first[:, None] + torch.arange(length))
        return cls(tuple(batches))


@dataclass(frozen=True, slots=True)
class VisionLayout:
    """Where each patch goes for the encoder: the window order, and each patch's (row, col),
    frame and window, all in that order."""

    order: torch.Tensor  # merge groups in window order: indices into the raster order
    rows: torch.Tensor  # [n] each patch's row in its frame, in window order
    cols: torch.Tensor
    frame: torch.Tensor  # [n] the frame (of all inputs) the patch belongs to
    window: torch.Tensor  # [n] the window (of all inputs) the patch belongs to


def vision_layout(grids: Sequence[Grid], cfg: QwenVisionConfig) -> VisionLayout:
    """The encoder's patch order and attention groups for inputs of these grids (patches come
    in merge groups of ``m x m`` consecutive rows, group by group in raster order)."""
    m = cfg.spatial_merge_size
    side = cfg.window_size // m // cfg.patch_size  # a window's side in merge groups
    order, rows, cols, frames, windows = [], [], [], [], []
    base = frame_base = window_base = 0
    for t, h, w in grids:
        gh, gw = h // m, w // m
        index = torch.arange(t * gh * gw).view(t, gh, gw)
        # A merge group's patches: rows r*m + i, cols c*m + j, in (i, j) order.
        i, j = torch.meshgrid(torch.arange(m), torch.arange(m), indexing="ij")
        group_rows = torch.arange(gh)[:, None, None, None] * m + i
        group_cols = torch.arange(gw)[None, :, None, None] * m + j
        grow = group_rows.expand(gh, gw, m, m).reshape(gh * gw, m * m)
        gcol = group_cols.expand(gh, gw, m, m).reshape(gh * gw, m * m)
        wrow, wcol = torch.arange(gh) // side, torch.arange(gw) // side
        per_row = -(-gw // side)
        window_of = (wrow[:, None] * per_row + wcol[None, :]).reshape(-1)  # per group
        per_frame = -(-gh // side) * per_row
        for f in range(t):
            # Windows in raster order of windows, groups in raster order within each.
            key = window_of * (gh * gw) + torch.arange(gh * gw)
            groups = torch.argsort(key)
            order.append(index[f].reshape(-1)[groups] + base)
            rows.append(grow[groups].reshape(-1))
            cols.append(gcol[groups].reshape(-1))
            frames.append(torch.full((gh * gw * m * m,), frame_base + f))
            win = window_of[groups] + window_base + f * per_frame
            windows.append(win.repeat_interleave(m * m))
        base += t * gh * gw
        frame_base += t
        window_base += t * per_frame
    return VisionLayout(
        torch.cat(order), torch.cat(rows), torch.cat(cols), torch.cat(frames), torch.cat(windows)
    )


class QwenVisionEncoder(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.num_layers))
        self.merger = PatchMerger(cfg)
        head_dim = cfg.hidden_size // cfg.num_heads
        quarter = head_dim // 2
        self.inv_freq = 1.0 / (
            cfg.rope_theta
            ** (torch.arange(0, quarter, 2, dtype=torch.float, device="cpu") / quarter)
        )

    def forward(self, patches: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """patches [n, patch_dim] (inputs one after another) -> [n / m^2, out_hidden]."""
        layout = vision_layout(grids, self.cfg)
        unit = self.cfg.spatial_merge_size**2
        x = self.patch_embed(patches)
        x = x.view(-1, unit, x.shape[-1])[layout.order].reshape(x.shape)
        freqs = torch.cat(
            (layout.rows[:, None] * self.inv_freq, layout.cols[:, None] * self.inv_freq), -1
        )
        angles = torch.cat((freqs, freqs), -1)
        cos, sin = angles.cos(), angles.sin()
        frame, window = Segments.of(layout.frame), Segments.of(layout.window)
        full = set(self.cfg.fullatt_block_indexes)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frame if i in full else window)
        merged = self.merger(x)
        return merged[torch.argsort(layout.order)]


def rope_index(
    num_tokens: int, media: Sequence[tuple[int, Grid, float]], cfg: QwenVisionConfig
) -> torch.Tensor:
    """A prompt's M-RoPE positions ``[3, num_tokens]``; ``media``: each image or video's first
    placeholder position, grid (in patches) and temporal step (0 for an image; for a video
    ``seconds_per_grid * tokens_per_second``), in prompt order."""
    m = cfg.spatial_merge_size
    parts: list[torch.Tensor] = []
    index = pos = 0
    for first, (t, h, w), step in media:
        if first > index:
            parts.append(torch.arange(first - index).expand(3, -1) + pos)
            pos += first - index
        gt, gh, gw = t, h // m, w // m
        temporal = (torch.arange(gt) * (step if step else 1)).long() if step else torch.zeros(gt)
        tt, hh, ww = torch.meshgrid(
            temporal.long(), torch.arange(gh), torch.arange(gw), indexing="ij"
        )
        grid = torch.stack((tt, hh, ww)).reshape(3, -1) + pos
        parts.append(grid)
        pos = int(grid.max()) + 1
        index = first + gt * gh * gw
    if num_tokens > index:
        parts.append(torch.arange(num_tokens - index).expand(3, -1) + pos)
    return torch.cat(parts, 1) if parts else torch.zeros(3, 0, dtype=torch.long)


class Qwen2_5_VLForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, rotary)
        if cfg.qwen_vision is None or cfg.mrope_section is None:
            raise ModelConfigError("a Qwen2.5-VL model needs a vision config and mrope_section")
        self.vision_config = cfg.qwen_vision
        self.mrope_section = cfg.mrope_section
        self.visual = QwenVisionEncoder(cfg.qwen_vision)
        self.encoder_calls = 0

    def layer_rotaries(self) -> None:
        return None  # M-RoPE: three positions a token, which the stack's rotation does not take

    def rotation_at(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        """M-RoPE for ``positions`` [3, n] (or plain [n]: text alone). The rotation is given
        as one table row per token (``positions`` 0..n-1 into it), so the fused kernel, which
        indexes its tables by position, applies it unchanged."""
        if positions.dim() == 1:
            positions = positions.expand(3, -1)
        freqs = positions[..., None].float() * self.rotary.inv_freq  # [3, n, half]
        parts = freqs.split(list(self.mrope_section), dim=-1)
        freq = torch.cat([p[i % 3] for i, p in enumerate(parts)], dim=-1)
        cos = torch.cat((freq, freq), -1).cos()
        signed_sin = torch.cat((-freq.sin(), freq.sin()), -1)
        rows = torch.arange(positions.shape[1])
        return Rotation(
            cos[:, None].to(dtype), signed_sin[:, None].to(dtype), rows, cos, signed_sin
        )

    def rope_index(self, num_tokens: int, media: Sequence[tuple[int, Grid, float]]) -> torch.Tensor:
        return rope_index(num_tokens, media, self.vision_config)

    def encode_grids(self, patches: torch.Tensor, grids: Sequence[Grid]) -> list[torch.Tensor]:
        """Images' and videos' patches, one after another, and their grids -> each one's
        embeddings ``[t * h * w / m^2, hidden]`` in the decoder's dtype, in the order of its
        placeholder tokens."""
        self.encoder_calls += 1
        dtype = self.visual.merger.ln_q.weight.dtype
        rows = self.visual(patches.to(dtype), grids).to(self.embed_tokens.weight.dtype)
        unit = self.vision_config.spatial_merge_size**2
        return list(rows.split([t * h * w // unit for t, h, w in grids]))
