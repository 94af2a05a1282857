"""Gemma 4's audio features (Gemma4AudioFeatureExtractor's) on numpy, and a clip's prompt text.

A mono clip at 16 kHz (cut at ``max_samples``, 30 s) is padded on the left by half a frame,
cut into frames of ``frame_length + 1`` samples every ``hop_length`` (each keeps its first
``frame_length``, or, with pre-emphasis, their differences), windowed (periodic Hann),
transformed (real FFT of ``fft_length``), and its magnitude mapped through an HTK mel filter
bank (no area norm), then ``log(mel + mel_floor)``, optionally standardized per bin. Only the
frames the extractor marks valid are made (it pads clips to a multiple of 128 samples and
masks the frames that reach into that padding), in its steps and dtypes: bit for bit its
values.

In the prompt, the audio token the chat template writes becomes ``boa`` + one audio token per
encoder row (``Gemma4AudioConfig.num_tokens`` of the frames) + ``eoa``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from inferd.models.config import Gemma4AudioConfig
from inferd.models.whisper_features import AudioFeatureError


def htk_mel_filters(
    bins: npt.NDArray[Any], num_mels: int, low: float, high: float
) -> npt.NDArray[np.float64]:
    """Triangular filters evenly spaced on the HTK mel scale between ``low`` and ``high``
    Hz, unnormalized, over the FFT bins at frequencies ``bins``: [len(bins), num_mels]."""

    def to_mel(hz: Any) -> Any:
        return 2595.0 * np.log10(1.0 + hz / 700.0)

    mels = np.linspace(to_mel(low), to_mel(high), num_mels + 2)
    edges = 700.0 * (np.power(10, mels / 2595.0) - 1.0)
    slopes = edges[None, :] - bins[:, None]
    widths = np.diff(edges)
    falling = -slopes[:, :-2] / widths[:-1]
    rising = slopes[:, 2:] / widths[1:]
    return np.maximum(np.zeros(1), np.minimum(falling, rising))


def preemphasized_frames(
    wave: npt.NDArray[Any], frame_length: int, hop: int, preemphasis: float, htk_flavor: bool
) -> npt.NDArray[Any]:
    """The frames [1, count, frame_length] of a clip [1, samples]: windows of
    ``frame_length + 1`` samples every ``hop`` (as many as fit), each keeping its first
    ``frame_length`` samples or, with pre-emphasis, their differences (HTK's flavor scales the
    first sample instead of dropping it), as Gemma's audio feature extractors frame a clip."""
    size = frame_length + 1
    count = max(0, (wave.shape[1] - size) // hop + 1)
    strides = (wave.strides[0], wave.strides[1] * hop, wave.strides[1])
    frames = np.lib.stride_tricks.as_strided(wave, (1, count, size), strides)
    if preemphasis > 0.0 and htk_flavor:
        first = frames[..., :1] * (1.0 - preemphasis)
        rest = frames[..., 1:-1] - preemphasis * frames[..., :-2]
        return np.concatenate([first, rest], axis=-1)
    if preemphasis > 0.0:
        return frames[..., 1:] - preemphasis * frames[..., :-1]
    return frames[..., :-1]


def _per_bin(value: Any, bins: int, name: str) -> tuple[float, ...] | None:
    """Per-bin statistics as saved ([bins], or transformers' [1, 1, bins] as nested lists)."""
    if value is None:
        return None
    flat = np.asarray(value, dtype=np.float64).reshape(-1)
    if flat.shape[0] != bins:
        raise AudioFeatureError(f"{name} has {flat.shape[0]} values for {bins} mel bins")
    return tuple(float(v) for v in flat)


class GemmaLogMelSettings:
    """What Gemma 3n's and Gemma 4's extractor configs share (their defaults differ): the
    settings both save, the frame, hop and FFT lengths in samples derived from them, and the
    last step, per-bin standardization."""

    __slots__ = ()
    feature_size: int
    sampling_rate: int
    frame_length_ms: float
    hop_length_ms: float
    min_frequency: float
    max_frequency: float
    preemphasis: float
    preemphasis_htk_flavor: bool
    fft_overdrive: bool
    input_scale_factor: float
    mel_floor: float
    per_bin_mean: tuple[float, ...] | None
    per_bin_stddev: tuple[float, ...] | None

    def saved_fields(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        """The fields above as the extractor's settings save them, this config's values where
        unsaved. The saved ``frame_length`` and ``hop_length`` (in samples) are ignored, as
        transformers ignores them on load: it derives both from the ``_ms`` settings and the
        sampling rate."""

        def number(name: str) -> float:
            # mel_floor is saved as an array (transformers keeps it as one)
            return float(np.asarray(settings.get(name, getattr(self, name))).item())

        def flag(name: str) -> bool:
            return bool(settings.get(name, getattr(self, name)))

        size = int(settings.get("feature_size", self.feature_size))
        return dict(
            feature_size=size,
            sampling_rate=int(settings.get("sampling_rate", self.sampling_rate)),
            frame_length_ms=number("frame_length_ms"),
            hop_length_ms=number("hop_length_ms"),
            min_frequency=number("min_frequency"),
            max_frequency=number("max_frequency"),
            preemphasis=number("preemphasis"),
            preemphasis_htk_flavor=flag("preemphasis_htk_flavor"),
            fft_overdrive=flag("fft_overdrive"),
            input_scale_factor=number("input_scale_factor"),
            mel_floor=number("mel_floor"),
            per_bin_mean=_per_bin(settings.get("per_bin_mean"), size, "per_bin_mean"),
            per_bin_stddev=_per_bin(settings.get("per_bin_stddev"), size, "per_bin_stddev"),
        )

    @property
    def frame_length(self) -> int:
        return round(self.sampling_rate * self.frame_length_ms / 1000.0)

    @property
    def hop_length(self) -> int:
        return round(self.sampling_rate * self.hop_length_ms / 1000.0)

    @property
    def fft_length(self) -> int:
        n = 2 ** math.ceil(math.log2(self.frame_length))
        return 2 * n if self.fft_overdrive else n

    def standardized(self, mel: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
        """Log-mel [1, frames, bins] less the per-bin mean, over the per-bin deviation (each
        when set), as the clip's features [frames, bins] in float32."""
        if self.per_bin_mean is not None:
            mel = mel - np.array(self.per_bin_mean).reshape(1, 1, -1)
        if self.per_bin_stddev is not None:
            mel = mel / np.array(self.per_bin_stddev).reshape(1, 1, -1)
        return mel[0].astype(np.float32)


@dataclass(frozen=True, slots=True)
class Gemma4AudioFeatureConfig(GemmaLogMelSettings):
    audio_token: str
    boa_token: str
    eoa_token: str
    feature_size: int = 128
    sampling_rate: int = 16_000
    frame_length_ms: float = 20.0
    hop_length_ms: float = 10.0
    min_frequency: float = 0.0
    max_frequency: float = 8000.0
    preemphasis: float = 0.0
    preemphasis_htk_flavor: bool = True
    fft_overdrive: bool = False
    input_scale_factor: float = 1.0
    mel_floor: float = 1e-3
    per_bin_mean: tuple[float, ...] | None = None
    per_bin_stddev: tuple[float, ...] | None = None
    max_samples: int = 480_000  # the extractor's max_length: longer clips are cut
    filters: npt.NDArray[np.float64] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        bins = np.linspace(0, self.sampling_rate // 2, self.fft_length // 2 + 1)
        filters = htk_mel_filters(bins, self.feature_size, self.min_frequency, self.max_frequency)
        object.__setattr__(self, "filters", filters)

    @classmethod
    def from_hf(
        cls, settings: Mapping[str, Any], tokens: tuple[str, str, str]
    ) -> Gemma4AudioFeatureConfig:
        """From the extractor's settings (``processor_config.json``'s ``feature_extractor``)
        and the tokenizer's (audio, boa, eoa) tokens."""
        if float(settings.get("dither") or 0.0):
            raise AudioFeatureError("dithered Gemma 4 audio features are not reproducible")
        return cls(*tokens, **cls(*tokens).saved_fields(settings))

    def num_frames(self, samples: int) -> int:
        """Valid frames of a clip of ``samples`` samples (after the cut)."""
        samples = min(samples, self.max_samples)
        return max(
            0, (samples + self.frame_length // 2 - self.frame_length - 1) // self.hop_length + 1
        )

    def num_tokens(self, samples: int) -> int:
        """Audio tokens of a clip of ``samples`` samples (the processor's count)."""
        frames = self.num_frames(samples)
        return Gemma4AudioConfig.num_tokens(frames) if frames else 0

    def prompt_text(self, samples: int) -> str:
        return self.boa_token + self.audio_token * self.num_tokens(samples) + self.eoa_token

    def log_mel(self, samples: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
        """A mono clip's features [frames, feature_size] in float32."""
        wave = np.asarray(samples, dtype=np.float32)[None, : self.max_samples]
        if self.input_scale_factor != 1.0:
            wave = wave * self.input_scale_factor
        wave = np.pad(wave, ((0, 0), (self.frame_length // 2, 0)), mode="constant")
        frames = preemphasized_frames(
            wave, self.frame_length, self.hop_length, self.preemphasis, self.preemphasis_htk_flavor
        )
        if not frames.shape[1]:
            return np.zeros((0, self.feature_size), dtype=np.float32)
        window = np.hanning(self.frame_length + 1)[:-1].astype(np.float32)  # periodic Hann
        spectrum = np.abs(np.fft.rfft(frames * window, n=self.fft_length, axis=-1))
        mel = np.log(np.matmul(spectrum, self.filters) + np.array(self.mel_floor))
        return self.standardized(mel)
