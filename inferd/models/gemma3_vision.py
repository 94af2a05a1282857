"""Gemma 3 with images (Gemma3ForConditionalGeneration): the SigLIP-style encoder of
models/vision.py, a projector that average-pools the patch grid down to
``mm_tokens_per_image`` tokens, normalizes them (Gemma's ``1 + w`` RMSNorm, the "soft
embedding norm") and projects them into the text model, and the Gemma 3 decoder of
models/gemma.py.

An image reaches the decoder through ``encode_images``: one row per ``<image_soft_token>`` of
the prompt, which the engine's runner writes over those tokens' (already scaled) embeddings.
Those tokens attend to each other both ways within one image (``VisionConfig.bidirectional``:
the engine gives each image's range to the prefill attention, layers/attention.py). Submodule
names follow the published checkpoints' (``vision_tower.vision_model.encoder.layers.N...``,
``multi_modal_projector.mm_input_projection_weight``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inferd.layers.rotary import RotaryEmbedding
from inferd.models.config import ModelConfig, ModelConfigError, VisionConfig
from inferd.models.gemma import Gemma3ForCausalLM, GemmaRMSNorm
from inferd.models.vision import VisionTransformer


class SiglipVisionTower(nn.Module):
    """transformers' SiglipVisionModel: the transformer under ``vision_model``."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.vision_model = VisionTransformer(cfg)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.vision_model(pixels)


class Gemma3Projector(nn.Module):
    """[images, patches, vision hidden] -> [images, tokens, text hidden]: pool each
    ``scale x scale`` block of the patch grid, norm, project."""

    def __init__(self, cfg: VisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.side = cfg.image_size // cfg.patch_size
        self.pool = cfg.scale_factor
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(cfg.hidden_size, text_hidden))
        self.mm_soft_emb_norm = GemmaRMSNorm(cfg.hidden_size, cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        images, _, hidden = x.shape
        grid = x.transpose(1, 2).reshape(images, hidden, self.side, self.side)
        pooled = F.avg_pool2d(grid, kernel_size=self.pool, stride=self.pool)
        tokens = self.mm_soft_emb_norm(pooled.flatten(2).transpose(1, 2))
        return torch.matmul(tokens, self.mm_input_projection_weight).type_as(x)


class Gemma3VisionForCausalLM(Gemma3ForCausalLM):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, rotary)
        if cfg.vision is None or not cfg.vision.pooled:
            raise ModelConfigError("a Gemma 3 vision model needs a pooled vision config")
        self.vision_config = cfg.vision
        self.vision_tower = SiglipVisionTower(cfg.vision)
        self.multi_modal_projector = Gemma3Projector(cfg.vision, cfg.hidden_size)
        self.encoder_calls = 0

    @property
    def image_token_id(self) -> int:
        return self.vision_config.image_token_id

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Images ``[n, 3, S, S]`` (one tile each: no pan-and-scan) -> their embeddings
        ``[n * mm_tokens_per_image, hidden]`` in the decoder's dtype, in prompt order."""
        self.encoder_calls += 1
        dtype = self.vision_tower.vision_model.post_layernorm.weight.dtype
        features = self.multi_modal_projector(self.vision_tower(pixel_values.to(dtype)))
        return features.reshape(-1, features.shape[-1]).to(self.embed_tokens.weight.dtype)
