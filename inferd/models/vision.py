"""A SigLIP-style vision transformer: patch embedding, learned positions, pre-norm encoder
layers (LayerNorm, bidirectional attention with biases, GELU MLP), a final LayerNorm.

It encodes a batch of equal-sized square tiles ``[tiles, 3, H, W]`` into
``[tiles, patches, hidden]``. Submodule names follow the checkpoints' (``embeddings``,
``encoder.layers.N.self_attn.q_proj``, ``post_layernorm``), so loading maps names one to one.
Plain ``torch`` layers: the encoder runs once per image (and its result is cached by digest),
so the decoder's packed kernels and ISQ are not worth their complexity here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inferd.models.config import VisionConfig


def _activation(name: str, x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh" if name == "gelu_tanh" else "none")


class VisionEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.patch_size = cfg.patch_size
        self.side = cfg.image_size // cfg.patch_size  # patches per side of a full tile
        self.patch_embedding = nn.Conv2d(
            cfg.num_channels, cfg.hidden_size, kernel_size=cfg.patch_size, stride=cfg.patch_size
        )
        self.position_embedding = nn.Embedding(self.side**2, cfg.hidden_size)

    def position_ids(self, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """Each patch's position on the full tile's grid: a grid of other size is spread over
        it by fractional coordinates (NaViT-style), computed in the same float steps as the
        reference so that a full grid maps to 0..side^2-1 exactly as it does there."""
        boundaries = torch.arange(1 / self.side, 1.0, 1 / self.side, device=device)

        def buckets(n: int) -> torch.Tensor:
            step = 1.0 / torch.tensor([n], device=device)
            coords = torch.arange(n, device=device, dtype=torch.float32) * step
            return torch.bucketize(coords.clamp(max=1.0 - 1e-6), boundaries, right=True)

        return (buckets(rows)[:, None] * self.side + buckets(cols)[None, :]).reshape(-1)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels)  # [tiles, hidden, rows, cols]
        rows, cols = patches.shape[-2:]
        embeddings = patches.flatten(2).transpose(1, 2)
        return embeddings + self.position_embedding(self.position_ids(rows, cols, pixels.device))


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiles, n, hidden = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(tiles, n, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch
        return self.out_proj(out.transpose(1, 2).reshape(tiles, n, hidden))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.act = cfg.hidden_act
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(_activation(self.act, self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = VisionAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(cfg) for _ in range(cfg.num_layers))


class VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(cfg)
        self.encoder = VisionEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[tiles, channels, H, W] -> [tiles, patches, hidden]."""
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
