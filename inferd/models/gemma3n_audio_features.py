"""Gemma 3n's audio features (Gemma3nAudioFeatureExtractor's) on numpy, and a clip's prompt text.

A mono clip at 16 kHz, cut at ``max_samples`` (30 s), is padded with zeros to a multiple of 128
samples (the extractor's ``pad_to_multiple_of``), cut into frames of ``frame_length + 1``
samples every ``hop_length`` (each keeps its first ``frame_length``, or, with pre-emphasis,
their differences), windowed (periodic Hann, in float32), transformed (real FFT of
``fft_length``: the frame's power of two, doubled by ``fft_overdrive``), and its magnitude
mapped through an HTK mel filter bank (no area norm, over the bins ``k * rate / fft_length``),
then ``log(max(mel, mel_floor))``, optionally standardized per bin: bit for bit its values,
in its steps and dtypes. One clip alone has no padded frames (a frame starts within the clip
whenever it ends within the 128-sample padding), so every frame is valid.

Unlike Gemma 4's, a clip's prompt text does not follow its length: the processor writes
``boa`` + ``soft_tokens`` audio tokens (188) + ``eoa`` for every clip, between blank lines, and
the model fills the audio tokens past the clip's own rows with a padding embedding.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from inferd.models.gemma4_audio_features import (
    GemmaLogMelSettings,
    htk_mel_filters,
    preemphasized_frames,
)
from inferd.models.whisper_features import AudioFeatureError

PAD_TO_MULTIPLE = 128  # the extractor pads every clip to a multiple of this many samples


@dataclass(frozen=True, slots=True)
class Gemma3nAudioFeatureConfig(GemmaLogMelSettings):
    audio_token: str
    boa_token: str
    eoa_token: str
    soft_tokens: int = 188  # the processor's audio_seq_length
    feature_size: int = 128
    sampling_rate: int = 16_000
    frame_length_ms: float = 32.0
    hop_length_ms: float = 10.0
    min_frequency: float = 125.0
    max_frequency: float = 7600.0
    preemphasis: float = 0.97
    preemphasis_htk_flavor: bool = True
    fft_overdrive: bool = True
    input_scale_factor: float = 1.0
    mel_floor: float = 1e-5
    per_bin_mean: tuple[float, ...] | None = None
    per_bin_stddev: tuple[float, ...] | None = None
    max_samples: int = 480_000  # the extractor's max_length: longer clips are cut
    filters: npt.NDArray[np.float64] = field(init=False, repr=False, compare=False)
    window: npt.NDArray[np.float32] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        bins = np.arange(self.fft_length // 2 + 1, dtype=np.float32)
        bins = bins * (self.sampling_rate / self.fft_length)
        filters = htk_mel_filters(bins, self.feature_size, self.min_frequency, self.max_frequency)
        object.__setattr__(self, "filters", filters)
        n = np.arange(self.frame_length, dtype=np.float32)
        window = 0.5 * (1 - np.cos(2 * np.pi * n / self.frame_length))
        object.__setattr__(self, "window", window.astype(np.float32))

    @classmethod
    def from_hf(
        cls, settings: Mapping[str, Any], tokens: tuple[str, str, str], soft_tokens: int
    ) -> Gemma3nAudioFeatureConfig:
        """From the extractor's settings and the tokenizer's (audio, boa, eoa) tokens."""
        if float(settings.get("dither") or 0.0):
            raise AudioFeatureError("dithered Gemma 3n audio features are not reproducible")
        if settings.get("padding_side", "right") != "right":
            raise AudioFeatureError("Gemma 3n audio padded on the left is not supported")
        fields = cls(*tokens).saved_fields(settings)
        return cls(*tokens, soft_tokens=soft_tokens, **fields)

    def num_frames(self, samples: int) -> int:
        """Frames of a clip of ``samples`` samples (cut at ``max_samples``, padded to a
        multiple of 128)."""
        padded = -(-min(samples, self.max_samples) // PAD_TO_MULTIPLE) * PAD_TO_MULTIPLE
        return max(0, (padded - self.frame_length - 1) // self.hop_length + 1)

    def prompt_text(self) -> str:
        """What stands for any clip in the prompt (the processor adds blank lines around)."""
        return self.boa_token + self.audio_token * self.soft_tokens + self.eoa_token

    def log_mel(self, samples: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
        """A mono clip's features [frames, feature_size] in float32."""
        wave = np.asarray(samples, dtype=np.float32)[None, : self.max_samples]
        pad = -wave.shape[1] % PAD_TO_MULTIPLE
        wave = np.pad(wave, ((0, 0), (0, pad)), mode="constant")
        if self.input_scale_factor != 1.0:
            wave = wave * self.input_scale_factor
        frames = preemphasized_frames(
            wave, self.frame_length, self.hop_length, self.preemphasis, self.preemphasis_htk_flavor
        )
        spectrum = np.abs(np.fft.rfft(frames * self.window, n=self.fft_length, axis=-1))
        mel = np.log(np.maximum(np.matmul(spectrum, self.filters), np.array(self.mel_floor)))
        return self.standardized(mel)
