"""Qwen3-VL: an image and video encoder whose middle blocks also feed the decoder ("deep
stack"), over the Qwen3 decoder of models/llama.py (q/k norms) turned by interleaved M-RoPE.

The encoder takes the same flat patches as Qwen2.5-VL's (models/qwen2_vl_image.py makes them,
16 px patches here) in merge-group order. Its patch embedding has a bias; a learned square grid
of position embeddings is resampled bilinearly (corners aligned) to each frame's patch grid and
added; its blocks (LayerNorm, attention with the same 2D rotary as Qwen2.5-VL's over a whole
frame, LayerNorm, a GELU MLP) have no windows. The merger (LayerNorm, then an MLP over each
2x2 group) gives one row per placeholder token; each block named in ``deepstack_indexes`` also
gives one through a merger of its own (LayerNorm after the 2x2 shuffle), and the k-th of those
rows is added to the hidden states leaving decoder layer k at the media's positions.

So that the engine's path for media (embeddings with the encoder's rows written over the
placeholders, the encoder cache, chunked prefill) carries the deep-stack rows unchanged, an
encoder row here is the main row followed by its deep-stack rows, ``(1 + k) * hidden`` wide,
and ``embed`` gives text tokens the same width with zeros after the embedding: ``forward``
splits them again. A step without media passes no embeddings and skips the deep stack.

M-RoPE interleaves the sections: rotary pair ``j`` turns by the height position when
``j % 3 == 1`` and ``j < 3 * sections[1]``, by the width position when ``j % 3 == 2`` and
``j < 3 * sections[2]``, else by the temporal one. Every image and every temporal patch of a
video is its own run of placeholders (the processor writes a timestamp before each of a video's
frames), laid out as a one-frame grid: ``rope_index`` of models/qwen2_5_vl.py, grids of t = 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from inferd.kernels.ops import Rotation
from inferd.layers.attention import AttentionMetadata
from inferd.layers.rotary import RotaryEmbedding
from inferd.models.config import ModelConfig, ModelConfigError, QwenVisionConfig
from inferd.models.decode_stack import KVCache
from inferd.models.llama import LlamaForCausalLM
from inferd.models.qwen2_5_vl import Grid, Segments, VisionAttention, rope_index


class PatchEmbed(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # The kernel covers the whole patch: the convolution is one matmul over its values.
        return F.linear(patches, self.proj.weight.flatten(1), self.proj.bias)


class VisionMLP(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: Segments
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, frames)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm and a GELU MLP over each merge group's patches; the deep-stack mergers
    normalize after gathering the group (``shuffled``), the last one before."""

    def __init__(self, cfg: QwenVisionConfig, shuffled: bool) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.shuffled = shuffled
        self.norm = nn.LayerNorm(self.width if shuffled else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.shuffled else self.norm(x)
        return self.linear_fc2(F.gelu(self.linear_fc1(x.view(-1, self.width))))


def patch_coordinates(grids: Sequence[Grid], merge: int) -> tuple[torch.Tensor, ...]:
    """Each patch's (row, col) in its frame and its frame's index (of all inputs), in the
    merge-group order the patches come in."""
    rows, cols, frames = [], [], []
    frame = 0
    for t, h, w in grids:
        r = torch.arange(h).view(h // merge, 1, merge, 1).expand(-1, w // merge, -1, merge)
        c = torch.arange(w).view(1, w // merge, 1, merge).expand(h // merge, -1, merge, -1)
        rows.append(r.reshape(-1).repeat(t))
        cols.append(c.reshape(-1).repeat(t))
        frames.append(torch.arange(frame, frame + t).repeat_interleave(h * w))
        frame += t
    return torch.cat(rows), torch.cat(cols), torch.cat(frames)


def grid_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, ...]:
    """Bilinear resampling with the corners aligned of a ``side``-long axis to ``size`` points:
    for each point ``index``, its two source entries and their weights."""
    src = index.float() * (side - 1) / (size - 1).clamp(min=1)
    low = src.floor()
    frac = src - low
    low_i = low.long().clamp(0, side - 1)
    high_i = (low_i + 1).clamp(max=side - 1)
    return low_i, high_i, 1 - frac, frac


class Qwen3VisionEncoder(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.side = round(cfg.num_position_embeddings**0.5)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.num_layers))
        self.merger = PatchMerger(cfg, shuffled=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(cfg, shuffled=True) for _ in cfg.deepstack_indexes
        )
        quarter = cfg.hidden_size // cfg.num_heads // 2
        self.inv_freq = 1.0 / (
            cfg.rope_theta
            ** (torch.arange(0, quarter, 2, dtype=torch.float, device="cpu") / quarter)
        )

    def positions(
        self, rows: torch.Tensor, cols: torch.Tensor, grids: Sequence[Grid]
    ) -> torch.Tensor:
        """The learned grid resampled to each patch's (row, col) of its frame's size."""
        counts = torch.tensor([t * h * w for t, h, w in grids])
        heights = torch.tensor([h for _, h, _ in grids]).repeat_interleave(counts)
        widths = torch.tensor([w for _, _, w in grids]).repeat_interleave(counts)
        r0, r1, rw0, rw1 = grid_taps(rows, heights, self.side)
        c0, c1, cw0, cw1 = grid_taps(cols, widths, self.side)
        table = self.pos_embed.weight
        out = torch.zeros(rows.shape[0], table.shape[1], dtype=table.dtype)
        for r, rw in ((r0, rw0), (r1, rw1)):
            for c, cw in ((c0, cw0), (c1, cw1)):
                out += table[r * self.side + c] * (rw * cw)[:, None].to(table.dtype)
        return out

    def forward(
        self, patches: torch.Tensor, grids: Sequence[Grid]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """patches [n, patch_dim] (inputs one after another) -> the merged rows
        [n / m^2, out_hidden] and each deep-stack level's, in the patches' order."""
        rows, cols, frame = patch_coordinates(grids, self.cfg.spatial_merge_size)
        x = self.patch_embed(patches)
        x = x + self.positions(rows, cols, grids)
        freqs = torch.cat((rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq), -1)
        angles = torch.cat((freqs, freqs), -1)
        cos, sin = angles.cos(), angles.sin()
        frames = Segments.of(frame)
        deep = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            if i in self.cfg.deepstack_indexes:
                merger = self.deepstack_merger_list[self.cfg.deepstack_indexes.index(i)]
                deep.append(merger(x))
        return self.merger(x), deep


def interleaved_axes(sections: Sequence[int], half: int) -> torch.Tensor:
    """The axis (0 temporal, 1 height, 2 width) that turns each of ``half`` rotary pairs (on
    the CPU: the model is built on ``meta``, this is no parameter)."""
    j = torch.arange(half, device="cpu")
    axes = torch.zeros(half, dtype=torch.long, device="cpu")
    for axis in (1, 2):
        axes[(j % 3 == axis) & (j < 3 * sections[axis])] = axis
    return axes


class Qwen3VLForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, rotary)
        if cfg.qwen_vision is None or cfg.mrope_section is None:
            raise ModelConfigError("a Qwen3-VL model needs a vision config and mrope_section")
        self.vision_config = cfg.qwen_vision
        self.axes = interleaved_axes(cfg.mrope_section, cfg.rotary_size // 2)
        self.visual = Qwen3VisionEncoder(cfg.qwen_vision)
        self.levels = len(cfg.qwen_vision.deepstack_indexes)
        self.encoder_calls = 0

    def layer_rotaries(self) -> None:
        return None  # M-RoPE: three positions a token, which the stack's rotation does not take

    def rotation_at(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        """Interleaved M-RoPE for ``positions`` [3, n] (or [n]: text alone), one table row per
        token as in Qwen2.5-VL's."""
        if positions.dim() == 1:
            positions = positions.expand(3, -1)
        freqs = positions[..., None].float() * self.rotary.inv_freq  # [3, n, half]
        half = freqs.shape[-1]
        freq = freqs[self.axes, :, torch.arange(half)].T  # [n, half]: each pair's own axis
        cos = torch.cat((freq, freq), -1).cos()
        signed_sin = torch.cat((-freq.sin(), freq.sin()), -1)
        rows = torch.arange(positions.shape[1])
        return Rotation(
            cos[:, None].to(dtype), signed_sin[:, None].to(dtype), rows, cos, signed_sin
        )

    def rope_index(self, num_tokens: int, media: Sequence[tuple[int, Grid, float]]) -> torch.Tensor:
        """M-RoPE positions; each run of placeholders is one image or one temporal patch of a
        video (grid t = 1: the processor writes a timestamp between a video's). A run of
        several temporal patches (a prompt without the timestamps) is laid out as that many
        runs one after another."""
        unit = self.vision_config.spatial_merge_size**2
        runs = [
            (first + k * h * w // unit, (1, h, w), 0.0)
            for first, (t, h, w), _ in media
            for k in range(t)
        ]
        return rope_index(num_tokens, runs, self.vision_config)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings, zero deep-stack rows after each (the module's docstring)."""
        x = self.embed_tokens(input_ids)
        if not self.levels:
            return x
        return torch.cat((x, x.new_zeros(x.shape[0], self.levels * x.shape[1])), -1)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As the decoder's, with ``embeds`` (when given) ``(1 + levels) * hidden`` wide: the
        input rows, then what each of the first ``levels`` layers' output gains."""
        if embeds is None:  # no media in the step: the plain embeddings, no deep stack
            embeds = self.embed_tokens(input_ids)
        if embeds.shape[-1] == self.config.hidden_size:
            return super().forward(input_ids, positions, meta, kv_caches, embeds)
        hidden = self.config.hidden_size
        x, deep = embeds[:, :hidden], embeds[:, hidden:].view(-1, self.levels, hidden)
        rotation = self.rotation_at(positions, x.dtype)
        delta: torch.Tensor | None = None
        layers: Any = zip(self.layers, kv_caches, strict=True)
        for i, (layer, cache) in enumerate(layers):
            x, step = layer.forward_split(x, delta, rotation, meta, cache)
            # The deep-stack rows join the layer's output (text rows gain zeros).
            x, delta = (x + step + deep[:, i], None) if i < self.levels else (x, step)
        return self.norm.add_forward(x, delta)[1]

    def encode_grids(self, patches: torch.Tensor, grids: Sequence[Grid]) -> list[torch.Tensor]:
        """Images' and videos' patches, one after another, and their grids -> each one's rows
        ``[t * h * w / m^2, (1 + levels) * hidden]`` (the main row, then the deep-stack rows)
        in the decoder's dtype, in the order of its placeholder tokens."""
        self.encoder_calls += 1
        dtype = self.visual.merger.norm.weight.dtype
        main, deep = self.visual(patches.to(dtype), grids)
        rows = torch.cat([main, *deep], -1).to(self.embed_tokens.weight.dtype)
        unit = self.vision_config.spatial_merge_size**2
        return list(rows.split([t * h * w // unit for t, h, w in grids]))
