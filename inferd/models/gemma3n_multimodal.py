"""Gemma 3n with its audio encoder (Gemma3nForConditionalGeneration's audio path): the decoder
of models/gemma3n.py under the conformer of models/gemma3n_audio.py, whose rows go through
``embed_audio``'s soft path into the text model. Every clip fills the same number of audio
tokens (``Gemma3nAudioConfig.soft_tokens``, 188): its own rows first, then the embedding of
the audio range's last id (transformers' padding for a clip shorter than 30 s). The runner
writes them over the audio tokens' embeddings; their per-layer embeddings (PLE) are row 0's,
as for every id past the PLE table.

Its image encoder, MobileNet-v5 (models/gemma3n_vision.py), fuses each image to a fixed grid
of ``soft_tokens`` rows, which take ``embed_vision``'s soft path the same way. A checkpoint
may carry either encoder or both.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inferd.layers.rotary import RotaryEmbedding
from inferd.models.config import ModelConfig, ModelConfigError
from inferd.models.gemma3n import Gemma3nForCausalLM, MediaTokenEmbedder
from inferd.models.gemma3n_audio import Gemma3nAudioEncoder
from inferd.models.gemma3n_vision import Gemma3nVisionTower


class Gemma3nMultimodalForCausalLM(Gemma3nForCausalLM):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, rotary)
        vision = cfg.gemma3n_vision
        if vision is not None:
            if "embed_vision" not in self.media_vocab:
                raise ModelConfigError("a Gemma 3n image model needs embed_vision")
            self.vision_tower = Gemma3nVisionTower(vision)
        audio = cfg.gemma3n_audio
        if audio is None:
            return
        if "embed_audio" not in self.media_vocab:
            raise ModelConfigError("a Gemma 3n audio model needs audio_config and embed_audio")
        self.audio_tower = Gemma3nAudioEncoder(audio)
        self.soft_tokens = audio.soft_tokens
        # transformers pads with the vocabulary's last id, which must be the audio range's
        self.padding_id = cfg.vocab_size - 1
        embedder = self.audio_embedder
        if not 0 <= self.padding_id - embedder.offset < embedder.size:
            raise ModelConfigError(
                f"gemma3n's audio padding id {self.padding_id} lies outside the audio range"
            )

    def media_embedder(self, name: str) -> MediaTokenEmbedder:
        embedder = getattr(self, name)
        assert isinstance(embedder, MediaTokenEmbedder)
        return embedder

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Images ``[n, 3, S, S]`` -> their embeddings ``[n * soft tokens, hidden]`` in the
        decoder's dtype, in prompt order."""
        dtype = self.vision_tower.timm_model.conv_stem.conv.weight.dtype
        rows = self.vision_tower(pixel_values.to(dtype))
        rows = self.media_embedder("embed_vision").embed_soft(rows.flatten(0, 1))
        return rows.to(self.embed_tokens.weight.dtype)

    @property
    def audio_embedder(self) -> MediaTokenEmbedder:
        return self.media_embedder("embed_audio")

    def encode_clip(self, features: torch.Tensor) -> torch.Tensor:
        """One clip's log-mel frames [frames, mel bins] -> its embeddings [soft tokens,
        hidden] in the decoder's dtype."""
        embedder = self.audio_embedder
        rows = embedder.embed_soft(self.audio_tower(features))
        if rows.shape[0] > self.soft_tokens:
            raise ValueError(
                f"an audio clip encodes to {rows.shape[0]} rows, past the model's "
                f"{self.soft_tokens} audio tokens"
            )
        padding = embedder.embed_ids(torch.tensor([self.padding_id])).to(rows.dtype)
        rows = torch.cat((rows, padding.expand(self.soft_tokens - rows.shape[0], -1)))
        return rows.to(self.embed_tokens.weight.dtype)

    def encode_audio(self, features: torch.Tensor, frames: Sequence[int]) -> list[torch.Tensor]:
        """Clips' log-mel frames, one after another [sum of ``frames``, mel bins] -> each
        clip's embeddings (the runner's call for a batch of clips)."""
        return [self.encode_clip(clip) for clip in features.split(list(frames))]
