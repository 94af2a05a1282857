"""Whisper's log-mel features (WhisperFeatureExtractor's, as Qwen2-Audio's processor calls it):
the clip is cut or zero-padded to the window (``chunk_length`` s), framed by a centred STFT
(reflect padding, Hann window of ``n_fft``, hop ``hop_length``; the last frame dropped), its
power spectrum mapped through a Slaney mel filter bank (0-8 kHz), log10 floored at 1e-10, each
value at least the window's maximum minus 8, then scaled as (x + 4) / 4.

The filter bank is built in float64 as the reference builds it and the spectrum is computed in
float32 with torch.stft as its torch path does: the features are bit-identical to
transformers' on the same torch (the parity test allows 2e-5 for another BLAS's summation).
``frames`` (the attention mask's count) is the number of frames that start inside the clip:
ceil(samples / hop), at most the window's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt
import torch


class AudioFeatureError(ValueError):
    """Feature extraction settings inferd cannot follow; the message says which."""


@dataclass(frozen=True)
class WhisperFeatureConfig:
    feature_size: int = 80  # mel bins
    sampling_rate: int = 16000
    hop_length: int = 160
    chunk_length: int = 30  # seconds in a window: shorter clips are padded, longer cut
    n_fft: int = 400

    @classmethod
    def from_hf(cls, settings: Mapping[str, Any]) -> WhisperFeatureConfig:
        kind = settings.get("feature_extractor_type", "WhisperFeatureExtractor")
        if kind != "WhisperFeatureExtractor":
            raise AudioFeatureError(f"audio features by {kind!r} are not supported")
        if settings.get("do_normalize") or float(settings.get("dither", 0.0)) != 0.0:
            raise AudioFeatureError("Whisper features with do_normalize or dither: not supported")
        if float(settings.get("padding_value", 0.0)) != 0.0:
            raise AudioFeatureError("Whisper features padded with other than silence")
        return cls(
            feature_size=int(settings.get("feature_size", 80)),
            sampling_rate=int(settings.get("sampling_rate", 16000)),
            hop_length=int(settings.get("hop_length", 160)),
            chunk_length=int(settings.get("chunk_length", 30)),
            n_fft=int(settings.get("n_fft", 400)),
        )

    @property
    def n_samples(self) -> int:
        return self.chunk_length * self.sampling_rate

    @property
    def max_frames(self) -> int:
        return self.n_samples // self.hop_length

    @cached_property
    def mel_filters(self) -> torch.Tensor:
        """[n_fft // 2 + 1, feature_size] float32, from the float64 bank."""
        bank = slaney_mel_filters(1 + self.n_fft // 2, self.feature_size, self.sampling_rate)
        return torch.from_numpy(bank).float()


def _hz_to_mel(hz: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Slaney's scale: linear below 1 kHz, logarithmic above."""
    mel = 3.0 * hz / 200.0
    log = hz >= 1000.0
    mel[log] = 15.0 + np.log(hz[log] / 1000.0) * (27.0 / np.log(6.4))
    return mel


def _mel_to_hz(mel: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    hz = 200.0 * mel / 3.0
    log = mel >= 15.0
    hz[log] = 1000.0 * np.exp((np.log(6.4) / 27.0) * (mel[log] - 15.0))
    return hz


def slaney_mel_filters(num_bins: int, num_mels: int, sampling_rate: int) -> npt.NDArray[np.float64]:
    """Triangular filters evenly spaced on Slaney's mel scale from 0 to 8 kHz, each scaled to
    unit area (Slaney norm): [num_bins, num_mels]."""
    edges = _hz_to_mel(np.array([0.0, 8000.0]))
    centres = _mel_to_hz(np.linspace(edges[0], edges[1], num_mels + 2))
    fft_freqs = np.linspace(0, sampling_rate // 2, num_bins)
    widths = np.diff(centres)
    slopes = centres[None, :] - fft_freqs[:, None]
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    bank = np.maximum(np.zeros(1), np.minimum(down, up))
    return bank * (2.0 / (centres[2 : num_mels + 2] - centres[:num_mels]))[None, :]


@dataclass(frozen=True, slots=True)
class AudioFeatures:
    features: torch.Tensor  # [feature_size, max_frames] float32: the whole window
    frames: int  # how many of them the clip covers (the extractor's attention mask's sum)


def log_mel(samples: npt.NDArray[np.float32], cfg: WhisperFeatureConfig) -> AudioFeatures:
    """One mono clip at ``cfg.sampling_rate`` -> its window's features."""
    n = min(len(samples), cfg.n_samples)
    wave = torch.zeros(cfg.n_samples, dtype=torch.float32)
    wave[:n] = torch.from_numpy(np.ascontiguousarray(samples[:n], dtype=np.float32))
    window = torch.hann_window(cfg.n_fft)
    stft = torch.stft(wave, cfg.n_fft, cfg.hop_length, window=window, return_complex=True)
    power = (stft[..., :-1].abs() ** 2).contiguous()
    spec = torch.clamp(cfg.mel_filters.T @ power, min=1e-10).log10()
    spec = torch.maximum(spec, spec.max() - 8.0)
    return AudioFeatures((spec + 4.0) / 4.0, -(-n // cfg.hop_length))
