"""Videos at odd frame rates: frames sampled by index, their times and pixels read back."""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np
import pytest

from inferd.media.limits import MediaLimits
from inferd.media.sniff import MP4
from inferd.media.video import (
    VideoSampling,
    _count_frames,
    _sampled_frames,
    _sought_frames,
    decode_video,
)
from tests.media.corpus import Clip, Corpus


def frame_index(frame: np.ndarray, clip: Clip) -> int:
    """Which generated frame this is, from its gray level (the levels of a clip are far apart)."""
    grays = np.array([Clip.gray(i) for i in range(clip.frames)])
    return int(np.abs(grays - frame.astype(np.float64).mean()).argmin())


@pytest.mark.parametrize(
    "name", ["gray-7.5fps.mp4", "gray-29.97fps-audio.mp4", "gray-25fps-gop6.mp4"]
)
@pytest.mark.parametrize(("fps", "max_frames"), [(2.0, 32), (100.0, 1000), (100.0, 4)])
def test_frames_are_sampled_evenly_with_their_times(
    media_corpus: Corpus, name: str, fps: float, max_frames: int
) -> None:
    path, clip = media_corpus.clips[name]
    video = decode_video(path.read_bytes(), sampling=VideoSampling(fps, max_frames))
    assert video.total_frames == clip.frames
    assert video.fps == pytest.approx(float(clip.fps))
    assert video.duration == pytest.approx(clip.frames / clip.fps, abs=1e-3)
    wanted = max(1, min(max_frames, clip.frames, int(np.ceil(video.duration * fps - 1e-9))))
    expected = [i * clip.frames // wanted for i in range(wanted)]
    assert list(video.frame_indices) == expected
    assert video.frames.shape == (wanted, clip.size[1], clip.size[0], 3)
    assert video.frames.dtype == np.uint8 and video.size == clip.size
    for index, stamp, frame in zip(
        video.frame_indices, video.timestamps, video.frames, strict=True
    ):
        assert stamp == pytest.approx(float(Fraction(index) / clip.fps), abs=1e-4)
        assert frame_index(frame, clip) == index
        assert abs(float(frame.mean()) - Clip.gray(index)) < 3


def test_sampling_at_two_fps_keeps_about_two_frames_a_second(media_corpus: Corpus) -> None:
    path, clip = media_corpus.clips["gray-7.5fps.mp4"]
    video = decode_video(path.read_bytes())
    assert len(video.frame_indices) == 6  # 2.67 s at 2 fps, rounded up
    images = video.images()
    assert [im.mode for im in images] == ["RGB"] * 6 and images[0].size == clip.size


def test_a_videos_sound_comes_when_asked(media_corpus: Corpus) -> None:
    path, clip = media_corpus.clips["gray-29.97fps-audio.mp4"]
    assert decode_video(path.read_bytes()).audio is None
    video = decode_video(path.read_bytes(), with_audio=True)
    assert clip.audio is not None and video.audio is not None
    assert video.audio.sample_rate == clip.audio.sample_rate and video.audio.channels == 1
    assert video.audio.digest == video.digest
    spectrum = np.abs(np.fft.rfft(video.audio.mono()))
    peak = np.fft.rfftfreq(video.audio.num_samples, 1 / video.audio.sample_rate)[spectrum.argmax()]
    assert peak == pytest.approx(clip.audio.freqs[0], abs=2)
    silent, _ = media_corpus.clips["gray-7.5fps.mp4"]
    assert decode_video(silent.read_bytes(), with_audio=True).audio is None


def test_the_frame_limit_counts_packets_not_the_header(media_corpus: Corpus) -> None:
    data = media_corpus.bytes("gray-7.5fps.mp4")
    assert decode_video(data, MediaLimits(max_video_frames=20)).total_frames == 20
    with pytest.raises(Exception, match="has 20 frames; this server decodes at most 19"):
        decode_video(data, MediaLimits(max_video_frames=19))


@pytest.mark.parametrize(
    "wanted", [[0, 7, 13, 20, 26, 32], [5, 6, 11, 12], [1], [32], list(range(33))]
)
def test_seeking_to_keyframes_gives_the_frames_a_full_decode_gives(
    media_corpus: Corpus, wanted: list[int]
) -> None:
    """Keyframes every 6 frames, B-frames between: each sample decoded from its keyframe is the
    frame, and the time, that decoding everything from the start gives."""
    data = media_corpus.bytes("gray-25fps-gop6.mp4")
    with av.open(io.BytesIO(data), format="mp4", mode="r") as container:
        packets = _count_frames(container, container.streams.video[0], MediaLimits())
    assert sum(p.key for p in packets) == 6
    sought = _sought_frames(data, MP4, wanted, MediaLimits(), packets)
    assert sought is not None  # the seeking path took every sample
    full = _sampled_frames(data, MP4, wanted, MediaLimits(), 25.0)
    assert sought[1] == full[1] == [pytest.approx(i / 25) for i in wanted]
    assert len(sought[0]) == len(full[0]) == len(wanted)
    for a, b in zip(sought[0], full[0], strict=True):
        assert np.array_equal(a, b)
