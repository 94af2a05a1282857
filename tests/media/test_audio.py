"""Audio decodes to the generator's signal, equal to an independent decoder (PyAV vs libsndfile)."""

from __future__ import annotations

import io
import math

import av
import numpy as np
import numpy.typing as npt
import pytest

from inferd.media.audio import decode_audio
from inferd.media.resample import resample
from tests.media.corpus import Corpus, Tone

# full scale of the integer PCM each file stores: the quantization step bounds the error
PCM = {"u8-mono-8k.wav": 128, "s16-mono-16k.wav": 32768, "s16-stereo-22k.wav": 32768}
PCM["s16-stereo-44k.flac"] = 32768


def pyav_pcm(data: bytes) -> tuple[npt.NDArray[np.float64], int]:
    """The same file through FFmpeg's decoders, scaled by hand: [channels, n] floats."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        chunks = []
        for frame in container.decode(stream):
            raw = frame.to_ndarray()
            if not frame.format.is_planar:  # packed: [1, n * channels]
                raw = raw.reshape(-1, len(frame.layout.channels)).T
            chunks.append(raw)
        samples = np.concatenate(chunks, axis=1)
        name = stream.format.name
    if name.startswith("u8"):
        return (samples.astype(np.float64) - 128) / 128, stream.sample_rate
    if name.startswith("s16"):
        return samples.astype(np.float64) / 32768, stream.sample_rate
    raise AssertionError(f"unexpected sample format {name}")


@pytest.mark.parametrize("name", sorted(PCM))
def test_pcm_audio_equals_pyav_and_the_generated_tone(media_corpus: Corpus, name: str) -> None:
    path, tone = media_corpus.tones[name]
    decoded = decode_audio(path.read_bytes())
    reference, rate = pyav_pcm(path.read_bytes())
    assert decoded.samples.dtype == np.float32
    assert decoded.sample_rate == rate == tone.sample_rate
    assert decoded.samples.shape == reference.shape == tone.signal().shape
    assert np.array_equal(decoded.samples, reference.astype(np.float32))
    step = 1 / PCM[name]
    assert np.abs(decoded.samples - tone.signal()).max() <= step
    assert decoded.duration == tone.signal().shape[1] / tone.sample_rate


@pytest.mark.parametrize(("name", "fmt"), [("mono-24k.mp3", "MP3"), ("aac-mono-16k.m4a", "MP4")])
def test_lossy_audio_holds_the_tone(media_corpus: Corpus, name: str, fmt: str) -> None:
    path, tone = media_corpus.tones[name]
    decoded = decode_audio(path.read_bytes())
    assert decoded.format == fmt and decoded.sample_rate == tone.sample_rate
    assert decoded.channels == 1
    # codecs add at most a couple of frames of priming and padding
    assert tone.seconds <= decoded.duration <= tone.seconds + 0.15
    assert dominant_frequency(decoded.mono(), decoded.sample_rate) == pytest.approx(
        tone.freqs[0], abs=2
    )


def dominant_frequency(samples: npt.NDArray[np.float32], rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples))
    return float(np.fft.rfftfreq(len(samples), 1 / rate)[spectrum.argmax()])


def test_stereo_keeps_its_channels_and_mono_is_their_mean(media_corpus: Corpus) -> None:
    path, tone = media_corpus.tones["s16-stereo-22k.wav"]
    decoded = decode_audio(path.read_bytes())
    assert decoded.channels == 2
    left, right = decoded.samples
    assert dominant_frequency(left, tone.sample_rate) == pytest.approx(440, abs=2)
    assert dominant_frequency(right, tone.sample_rate) == pytest.approx(660, abs=2)
    mono = decoded.mono()
    assert mono.shape == (decoded.num_samples,) and mono.dtype == np.float32
    assert np.allclose(mono, (left + right) / 2, atol=1e-7)
    single = decode_audio(media_corpus.bytes("s16-mono-16k.wav"))
    assert np.array_equal(single.mono(), single.samples[0])


@pytest.mark.parametrize("to_rate", [8000, 22050, 48000])
def test_resampling_keeps_the_tone_and_the_length(to_rate: int) -> None:
    source = Tone(16000, 1.0, (440.0, 700.0), 0.5)
    samples = source.signal().astype(np.float32)
    out = resample(samples, 16000, to_rate)
    assert out.dtype == np.float32
    assert out.shape == (2, math.ceil(samples.shape[1] * to_rate / 16000))
    expected = Tone(to_rate, 1.0, source.freqs, 0.5).signal()
    edge = to_rate // 50  # the filter's start-up and flush transients
    assert np.abs(out[:, edge:-edge] - expected[:, edge:-edge]).max() < 2e-3


def test_resampled_audio_keeps_its_digest_and_duration(media_corpus: Corpus) -> None:
    decoded = decode_audio(media_corpus.bytes("s16-stereo-44k.flac"))
    down = decoded.resampled(16000)
    assert down.sample_rate == 16000 and down.channels == 2 and down.digest == decoded.digest
    assert down.duration == pytest.approx(decoded.duration, abs=1e-3)
    assert decoded.resampled(44100) is decoded
