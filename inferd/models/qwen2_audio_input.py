"""A clip made ready for Qwen2-Audio, as its processor makes it: mono at the feature
extractor's rate, the window's log-mel features, and the prompt text standing for it (the
``<|AUDIO|>`` marker repeated once per encoder row, between the ``<|audio_bos|>`` and
``<|audio_eos|>`` the chat template writes around it)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from inferd.media.types import DecodedAudio
from inferd.models.config import AudioConfig
from inferd.models.whisper_features import WhisperFeatureConfig, log_mel

AUDIO_TOKEN = "<|AUDIO|>"


@dataclass(frozen=True, slots=True)
class PreparedAudio:
    features: torch.Tensor  # [1, mels, max_frames] float32: what ``encode_audio`` takes
    frames: int  # mel frames the clip covers

    @property
    def num_embeddings(self) -> int:
        return AudioConfig.num_tokens(self.frames)

    def prompt_text(self) -> str:
        return AUDIO_TOKEN * self.num_embeddings


def prepare_samples(samples: npt.NDArray[np.float32], cfg: WhisperFeatureConfig) -> PreparedAudio:
    """Mono samples already at ``cfg.sampling_rate``."""
    out = log_mel(samples, cfg)
    return PreparedAudio(out.features[None], out.frames)


def prepare_audio(audio: DecodedAudio, cfg: WhisperFeatureConfig) -> PreparedAudio:
    """A decoded clip at any rate: resampled, down-mixed, then featurized."""
    return prepare_samples(audio.resampled(cfg.sampling_rate).mono(), cfg)
