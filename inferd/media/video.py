"""Video with PyAV: frames sampled evenly by index, as transformers' video processors sample.

Before decoding: the container is opened with the demuxer its magic bytes name (FFmpeg never
probes untrusted bytes itself), it must hold a video stream, and the frame size, the declared
duration and the declared frame count must fit the limits. Then the packets are counted (a
demux, no decoding) so a header that under-declares its frames is caught before the decoder
runs. Only then is anything decoded: for each sampled frame, from the last keyframe before it
(the demux told where they are), and only the sampled frames are converted to RGB; a stream
without timestamps is decoded from the start instead.

Sampling: ``VideoSampling(fps, max_frames)`` keeps ``min(max_frames, ceil(duration * fps))``
frames (at least one) at indices ``floor(i * total / n)``: the spacing of transformers'
``np.arange(0, total, total / n)``. Timestamps are the sampled frames' presentation times.
"""

from __future__ import annotations

import bisect
import io
import math
from dataclasses import dataclass, replace
from typing import Protocol

import av
import numpy as np
import numpy.typing as npt

from inferd.media.audio import DEMUXERS, read_av_audio
from inferd.media.limits import MediaError, MediaLimits, reason
from inferd.media.sniff import AVI, MATROSKA, MP4, Format, check_declared, sniff_for
from inferd.media.types import DecodedAudio, DecodedVideo, digest_of

_CONTAINERS = (MP4, MATROSKA, AVI)

DEFAULT_SAMPLE_FPS = 2.0  # Qwen2-VL's default
DEFAULT_SAMPLE_FRAMES = 32


class FrameSampling(Protocol):
    """Which frames of a video to keep: a model's processor may sample its own way (SmolVLM2's
    ``models.smolvlm_video.SmolVLMVideoConfig``); ``VideoSampling`` is the default."""

    def indices(self, total: int, duration: float, fps: float = 0.0) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class VideoSampling:
    fps: float = DEFAULT_SAMPLE_FPS  # frames kept per second of video
    max_frames: int = DEFAULT_SAMPLE_FRAMES  # at most this many, spread over the whole video

    def __post_init__(self) -> None:
        if not self.fps > 0 or self.max_frames < 1:
            raise ValueError("video sampling needs fps > 0 and max_frames >= 1")

    def indices(self, total: int, duration: float, fps: float = 0.0) -> list[int]:
        """Which of ``total`` frames to keep, evenly spaced (``fps``, the stream's rate, is
        not needed here)."""
        wanted = max(1, min(self.max_frames, math.ceil(duration * self.fps - 1e-9), total))
        return [i * total // wanted for i in range(wanted)]


def decode_video(
    data: bytes,
    limits: MediaLimits | None = None,
    declared: str | None = None,
    sampling: FrameSampling | None = None,
    with_audio: bool = False,
) -> DecodedVideo:
    """Decode the sampled frames of one video; MediaError says what is wrong."""
    limits = limits or MediaLimits()
    sampling = sampling or VideoSampling()
    found = sniff_for(data, "video")
    if found not in _CONTAINERS:
        raise MediaError(f"{found.name} video is not supported; send MP4, WebM/Matroska or AVI")
    check_declared(declared, found)
    try:
        video = _decode(data, found, limits, sampling)
        if with_audio:
            video = _with_audio(video, data, found, limits)
    except MediaError:
        raise
    except MemoryError:
        raise MediaError(f"the {found.name} video needs more memory than is free") from None
    except (av.FFmpegError, RuntimeError, ValueError, OSError) as exc:
        raise MediaError(f"the {found.name} video cannot be decoded: {reason(exc)}") from None
    return video


def _decode(
    data: bytes, found: Format, limits: MediaLimits, sampling: FrameSampling
) -> DecodedVideo:
    with av.open(io.BytesIO(data), format=DEMUXERS[found.name], mode="r") as container:
        if not container.streams.video:
            raise MediaError(f"the {found.name} file has no video stream")
        stream = container.streams.video[0]
        context = stream.codec_context
        if context is None:  # FFmpeg has no decoder for what the stream says it holds
            raise MediaError(f"the {found.name} video stream's codec cannot be decoded")
        limits.check_pixels(int(context.width), int(context.height), "each video frame")
        fps = float(stream.average_rate or stream.guessed_rate or 0)
        if not fps > 0:
            raise MediaError(f"the {found.name} video declares no frame rate")
        seconds = _declared_seconds(stream, container)
        declared_frames = int(stream.frames) or (round(seconds * fps) if seconds else None)
        limits.check_video(seconds, declared_frames)
        packets = _count_frames(container, stream, limits)
    total = len(packets)
    if total == 0:
        raise MediaError(f"the {found.name} video stream holds no frames")
    duration = seconds if seconds else total / fps
    wanted = sampling.indices(total, duration, fps)
    sought = _sought_frames(data, found, wanted, limits, packets)
    frames, stamps = sought or _sampled_frames(data, found, wanted, limits, fps)
    if len(frames) < len(wanted):
        raise MediaError(
            f"the {found.name} video decodes to fewer frames than its {total} packets: "
            "it is truncated or corrupt"
        )
    return DecodedVideo(
        np.stack(frames),
        tuple(wanted),
        tuple(stamps),
        fps,
        total,
        duration,
        digest_of(data),
        found.name,
    )


def _declared_seconds(stream: av.video.stream.VideoStream, container: object) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    duration = getattr(container, "duration", None)
    return duration / av.time_base if duration else None


@dataclass(frozen=True, slots=True)
class _Packet:
    pts: int | None
    key: bool


def _count_frames(
    container: av.container.InputContainer, stream: av.video.stream.VideoStream, limits: MediaLimits
) -> list[_Packet]:
    """The packets holding a frame (demuxed, not decoded); stops past the frame limit."""
    packets = []
    for packet in container.demux(stream):
        if packet.size:
            packets.append(_Packet(packet.pts, bool(packet.is_keyframe)))
            if len(packets) > limits.max_video_frames:
                limits.check_video(None, len(packets))
    return packets


def _sought_frames(
    data: bytes, found: Format, wanted: list[int], limits: MediaLimits, packets: list[_Packet]
) -> tuple[list[npt.NDArray[np.uint8]], list[float]] | None:
    """The sampled frames, decoding from the last keyframe before each rather than from the
    start: a few frames per sample instead of the whole video. The frames are named by their
    presentation timestamps, known from the demux; None (the caller decodes sequentially)
    where the timestamps are missing or a frame does not come out where it should."""
    if any(p.pts is None for p in packets):
        return None
    order = sorted(int(p.pts) for p in packets if p.pts is not None)
    if len(set(order)) != len(order):
        return None
    keys = sorted(int(p.pts) for p in packets if p.key and p.pts is not None)
    frames: list[npt.NDArray[np.uint8]] = []
    stamps: list[float] = []
    with av.open(io.BytesIO(data), format=DEMUXERS[found.name], mode="r") as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        decoded = container.decode(stream)
        position = order[0] - 1  # pts of the last frame decoded
        for target in (order[i] for i in wanted):
            key = (
                keys[bisect.bisect_right(keys, target) - 1] if keys and keys[0] <= target else None
            )
            if key is not None and key > position:  # a keyframe lies between: jump to it
                container.seek(key, stream=stream, backward=True)
                decoded = container.decode(stream)
            frame = next((f for f in decoded if f.pts is None or f.pts >= target), None)
            if frame is None or frame.pts != target:  # the stream ended, or skipped the frame
                return None
            position = target
            limits.check_pixels(frame.width, frame.height, "each video frame")
            frames.append(np.asarray(frame.to_ndarray(format="rgb24"), np.uint8))
            stamps.append(float(frame.time or 0.0))
    if len({f.shape for f in frames}) > 1:
        raise MediaError(f"the {found.name} video changes its frame size midway")
    return frames, stamps


def _sampled_frames(
    data: bytes, found: Format, wanted: list[int], limits: MediaLimits, fps: float
) -> tuple[list[npt.NDArray[np.uint8]], list[float]]:
    keep = set(wanted)
    last = wanted[-1]
    frames: list[npt.NDArray[np.uint8]] = []
    stamps: list[float] = []
    with av.open(io.BytesIO(data), format=DEMUXERS[found.name], mode="r") as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for index, frame in enumerate(container.decode(stream)):
            if index in keep:
                # a stream may change size midway: each frame is checked before conversion
                limits.check_pixels(frame.width, frame.height, "each video frame")
                frames.append(np.asarray(frame.to_ndarray(format="rgb24"), np.uint8))
                stamps.append(float(frame.time) if frame.time is not None else index / fps)
            if index >= last:
                break
    if len({f.shape for f in frames}) > 1:
        raise MediaError(f"the {found.name} video changes its frame size midway")
    return frames, stamps


def _with_audio(
    video: DecodedVideo, data: bytes, found: Format, limits: MediaLimits
) -> DecodedVideo:
    decoded = read_av_audio(data, found, limits, required=False)
    if decoded is None or decoded[0].shape[1] == 0:
        return video
    samples, rate = decoded
    return replace(video, audio=DecodedAudio(samples, rate, video.digest, found.name))
