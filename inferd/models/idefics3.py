"""Idefics3 and SmolVLM (v1 and v2): a SigLIP-style image encoder, a pixel-shuffle connector,
and the Llama decoder of models/llama.py.

The decoder runs exactly as for text; an image reaches it through ``encode_images``, whose
output rows (one per ``<image>`` placeholder token, in prompt order) the engine's runner writes
over those tokens' embeddings (``forward(..., embeds=...)``). The runner caches the encoder's
output by the image's digest, so ``encoder_calls`` (a plain counter) says how often it really ran.
"""

from __future__ import annotations

import torch
from torch import nn

from inferd.layers.rotary import RotaryEmbedding
from inferd.models.config import ModelConfig, ModelConfigError, VisionConfig
from inferd.models.llama import LlamaForCausalLM
from inferd.models.vision import VisionTransformer

TILES_PER_PASS = 16  # tiles through the image encoder at once (the runner batches 16 too)


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[tiles, side*side, d] -> [tiles, side*side / scale^2, d * scale^2]: each token gathers
    ``scale`` neighbouring patches of a row from ``scale`` consecutive rows, in the reference's
    order (Idefics3Connector.pixel_shuffle)."""
    tiles, seq, dim = x.shape
    side = int(seq**0.5)
    x = x.view(tiles, side, side // scale, dim * scale)
    x = x.permute(0, 2, 1, 3).reshape(tiles, side // scale, side // scale, dim * scale * scale)
    return x.permute(0, 2, 1, 3).reshape(tiles, seq // scale**2, dim * scale**2)


class ModalityProjection(nn.Module):
    def __init__(self, cfg: VisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.hidden_size * cfg.scale_factor**2, text_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Idefics3Connector(nn.Module):
    def __init__(self, cfg: VisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.scale_factor = cfg.scale_factor
        self.modality_projection = ModalityProjection(cfg, text_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.modality_projection(pixel_shuffle(x, self.scale_factor))


class Idefics3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, rotary)
        if cfg.vision is None:
            raise ModelConfigError("an Idefics3 model needs a vision config")
        self.vision_config = cfg.vision
        self.vision_model = VisionTransformer(cfg.vision)
        self.connector = Idefics3Connector(cfg.vision, cfg.hidden_size)
        self.encoder_calls = 0

    @property
    def image_token_id(self) -> int:
        return self.vision_config.image_token_id

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """One image's tiles ``[tiles, 3, H, W]`` -> its embeddings ``[tiles * tokens, hidden]``
        in the decoder's dtype, in the order of its ``<image>`` tokens."""
        self.encoder_calls += 1
        dtype = self.vision_model.post_layernorm.weight.dtype
        # Tiles are independent: a long video's frames (64 in SmolVLM2's settings) are encoded
        # a few at a time so the encoder's attention never holds all of them at once.
        parts = [
            self.connector(self.vision_model(tiles.to(dtype)))
            for tiles in pixel_values.split(TILES_PER_PASS)
        ]
        features = torch.cat(parts)
        return features.reshape(-1, features.shape[-1]).to(self.embed_tokens.weight.dtype)
