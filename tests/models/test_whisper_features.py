"""Our Whisper log-mel features against transformers' WhisperFeatureExtractor on generated
signals: tones, noise, silence, short and long clips (cut at 30 s), 80 and 128 mel bins, and
8 kHz / 44.1 kHz clips brought to 16 kHz by DecodedAudio.resampled first.

Tolerance: 2e-5 absolute on features of magnitude ~1, and the frame count equal. Measured
here the features are bit-identical (both run the same float32 torch.stft and mel matmul on a
float32 copy of the same float64 filter bank); the slack covers a BLAS that sums the mel
projection in another order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inferd.media.types import DecodedAudio
from inferd.models.whisper_features import WhisperFeatureConfig, log_mel

RATE = 16000


def tone(seconds: float, hz: float, rate: int = RATE) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def noise(seconds: float, seed: int, rate: int = RATE) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.3 * rng.standard_normal(int(seconds * rate))).astype(np.float32)


SIGNALS = {
    "tone 2 s": tone(2.0, 440.0),
    "chirpy mix": tone(3.3, 1234.5) + noise(3.3, 1) * 0.1,
    "noise 7 s": noise(7.0, 2),
    "silence 1 s": np.zeros(RATE, dtype=np.float32),
    "short 0.01 s": tone(0.01, 3000.0),
    "odd length": noise(1.0, 3)[:16001],
    "long 31 s (cut)": tone(31.0, 200.0) + noise(31.0, 4) * 0.05,
}


def reference(samples: np.ndarray, mels: int) -> tuple[np.ndarray, int]:
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor(feature_size=mels, return_attention_mask=True)
    out = extractor(samples, sampling_rate=RATE, padding="max_length", return_attention_mask=True)
    return out["input_features"][0], int(out["attention_mask"][0].sum())


@pytest.mark.parametrize("mels", [80, 128])
@pytest.mark.parametrize("name", list(SIGNALS))
def test_features_match_whisper_extractor(name: str, mels: int) -> None:
    ref, frames = reference(SIGNALS[name], mels)
    ours = log_mel(SIGNALS[name], WhisperFeatureConfig(feature_size=mels))
    assert ours.features.shape == (mels, 3000)
    assert ours.frames == frames
    torch.testing.assert_close(ours.features, torch.from_numpy(ref), atol=2e-5, rtol=0)


@pytest.mark.parametrize("rate", [8000, 44100])
def test_resampled_input_matches(rate: int) -> None:
    """A clip at another rate goes through DecodedAudio.resampled (stereo down-mixed) first."""
    left, right = tone(2.5, 330.0, rate), noise(2.5, 5, rate)
    audio = DecodedAudio(np.stack([left, right]), rate, "x", "WAV")
    mono = audio.resampled(RATE).mono()
    assert abs(len(mono) - 2.5 * RATE) <= 2
    ref, frames = reference(mono, 128)
    ours = log_mel(mono, WhisperFeatureConfig(feature_size=128))
    assert ours.frames == frames
    torch.testing.assert_close(ours.features, torch.from_numpy(ref), atol=2e-5, rtol=0)


def test_settings_read_from_hf() -> None:
    cfg = WhisperFeatureConfig.from_hf(
        {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128}
    )
    assert (cfg.feature_size, cfg.max_frames, cfg.n_samples) == (128, 3000, 480000)
    with pytest.raises(ValueError, match="dither"):
        WhisperFeatureConfig.from_hf({"dither": 1e-5})
