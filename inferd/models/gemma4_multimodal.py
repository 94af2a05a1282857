"""Gemma 4 with its encoders (Gemma4ForConditionalGeneration): the decoder of models/gemma4.py
under the image encoder of models/gemma4_vision.py and the audio encoder of
models/gemma4_audio.py, whichever the checkpoint has. Each encoder's rows go through its own
``MultimodalEmbedder`` (``embed_vision``, ``embed_audio``) into the text model's width; the
runner writes them over the placeholder tokens' embeddings, whose per-layer embeddings
(PLE) are padding's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inferd.layers.rotary import RotaryEmbedding
from inferd.models.config import ModelConfig, ModelConfigError
from inferd.models.gemma4 import Gemma4ForCausalLM
from inferd.models.gemma4_audio import Gemma4AudioTower
from inferd.models.gemma4_vision import Gemma4VisionTower, MultimodalEmbedder


class Gemma4MultimodalForCausalLM(Gemma4ForCausalLM):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, rotary)
        if cfg.gemma4_vision is None and cfg.gemma4_audio is None:
            raise ModelConfigError("a Gemma 4 multimodal model needs an image or audio encoder")
        self.vision_tower: Gemma4VisionTower | None = None
        self.audio_tower: Gemma4AudioTower | None = None
        if cfg.gemma4_vision is not None:
            vision = cfg.gemma4_vision
            self.vision_tower = Gemma4VisionTower(vision)
            self.embed_vision = MultimodalEmbedder(
                vision.hidden_size, cfg.hidden_size, vision.rms_norm_eps
            )
        if cfg.gemma4_audio is not None:
            audio = cfg.gemma4_audio
            self.audio_tower = Gemma4AudioTower(audio)
            self.embed_audio = MultimodalEmbedder(
                audio.output_dims, cfg.hidden_size, audio.rms_norm_eps
            )

    def encode_patches(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One image's (or video frame's) patches and their (x, y) places -> its embeddings
        [soft tokens, hidden] in the decoder's dtype."""
        if self.vision_tower is None:
            raise ModelConfigError("this Gemma 4 checkpoint has no image encoder")
        dtype = self.embed_vision.embedding_projection.weight.dtype
        tokens = self.vision_tower(patches, positions.long()).to(dtype)
        return self.embed_vision(tokens).to(self.embed_tokens.weight.dtype)

    def encode_clip(self, features: torch.Tensor) -> torch.Tensor:
        """One clip's log-mel frames [frames, mel bins] -> its embeddings [tokens, hidden]
        (``Gemma4AudioConfig.num_tokens`` rows) in the decoder's dtype."""
        if self.audio_tower is None:
            raise ModelConfigError("this Gemma 4 checkpoint has no audio encoder")
        rows = self.embed_audio(self.audio_tower(features))
        return rows.to(self.embed_tokens.weight.dtype)

    def encode_audio(self, features: torch.Tensor, frames: Sequence[int]) -> list[torch.Tensor]:
        """Clips' log-mel frames, one after another [sum of ``frames``, mel bins] -> each
        clip's embeddings (the runner's call for a batch of clips)."""
        return [self.encode_clip(clip) for clip in features.split(list(frames))]
