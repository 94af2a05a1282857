"""Limits on decoded media, and the error every refusal or decoding failure raises.

Each limit is checked against what the file's header declares, before the pixels or samples
are decoded, and again while decoding where a header can lie (a WAV data chunk longer than the
file, a video with more packets than its header counts).
"""

from __future__ import annotations

from dataclasses import dataclass

# 36 megapixels: a 6000x6000 photo; 108 MB as RGB. Pillow's own bomb check (about 179 MP) stays
# behind this one. Applies to every image and to each video frame.
DEFAULT_MAX_IMAGE_PIXELS = 36_000_000
DEFAULT_MAX_VIDEO_SECONDS = 600.0
# Frames in a video stream, all of which are decoded to sample a few: 10 minutes at 30 fps.
DEFAULT_MAX_VIDEO_FRAMES = 18_000
DEFAULT_MAX_AUDIO_SECONDS = 600.0
DEFAULT_MAX_AUDIO_SAMPLE_RATE = 192_000
MAX_AUDIO_CHANNELS = 8  # 7.1; more is not speech or music a model was trained on


class MediaError(ValueError):
    """Media that cannot or may not be decoded; the message says why, for the caller.

    ``code`` sorts them: ``media_too_large`` (over a limit), ``media_type_mismatch`` (the
    declared type is not what the bytes are), ``invalid_media`` (corrupt, truncated, unsupported).
    """

    def __init__(self, message: str, code: str = "invalid_media") -> None:
        super().__init__(message)
        self.code = code


def reason(exc: BaseException) -> str:
    """A library's error, short and without FFmpeg's errno prefix, for a MediaError message."""
    text = getattr(exc, "strerror", None) or str(exc).strip() or type(exc).__name__
    return str(text)[:200]


def over_limit(message: str) -> MediaError:
    return MediaError(message, "media_too_large")


@dataclass(frozen=True, slots=True)
class MediaLimits:
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_video_seconds: float = DEFAULT_MAX_VIDEO_SECONDS
    max_video_frames: int = DEFAULT_MAX_VIDEO_FRAMES
    max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS
    max_audio_sample_rate: int = DEFAULT_MAX_AUDIO_SAMPLE_RATE
    # Images longer than this on their long side are scaled down to it, aspect kept, once
    # decoded (--max-edge); None: as they come.
    max_image_edge: int | None = None

    def __post_init__(self) -> None:
        if self.max_image_edge is not None and self.max_image_edge < 1:
            raise ValueError("--max-edge must be at least 1")
        for name in ("max_image_pixels", "max_video_frames", "max_audio_sample_rate"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        for name in ("max_video_seconds", "max_audio_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")

    def fitted(self, width: int, height: int) -> tuple[int, int]:
        """The size an image of ``width`` x ``height`` is given to the model: scaled down so
        its long side is at most ``max_image_edge``, aspect kept; unchanged when it fits."""
        edge = self.max_image_edge
        if edge is None or max(width, height) <= edge:
            return width, height
        scale = edge / max(width, height)
        return max(1, round(width * scale)), max(1, round(height * scale))

    def check_pixels(self, width: int, height: int, what: str = "the image") -> None:
        if width < 1 or height < 1:
            raise MediaError(f"{what} declares an empty size {width}x{height}")
        if width * height > self.max_image_pixels:
            raise over_limit(
                f"{what} is {width}x{height} = {width * height} pixels; this server decodes at "
                f"most {self.max_image_pixels} (--max-image-pixels)"
            )

    def check_audio(self, sample_rate: int, seconds: float | None, channels: int) -> None:
        if sample_rate < 1:
            raise MediaError(f"the audio declares a sample rate of {sample_rate} Hz")
        if sample_rate > self.max_audio_sample_rate:
            raise over_limit(
                f"the audio's sample rate is {sample_rate} Hz; this server takes at most "
                f"{self.max_audio_sample_rate} Hz (--max-audio-sample-rate)"
            )
        if not 1 <= channels <= MAX_AUDIO_CHANNELS:
            raise MediaError(
                f"the audio has {channels} channels; 1 to {MAX_AUDIO_CHANNELS} are supported"
            )
        if seconds is not None:
            self.check_audio_seconds(seconds)

    def check_audio_seconds(self, seconds: float) -> None:
        if seconds > self.max_audio_seconds:
            raise over_limit(
                f"the audio lasts {seconds:.1f} s; this server takes at most "
                f"{self.max_audio_seconds:g} s (--max-audio-seconds)"
            )

    def check_video(self, seconds: float | None, frames: int | None) -> None:
        if seconds is not None and seconds > self.max_video_seconds:
            raise over_limit(
                f"the video lasts {seconds:.1f} s; this server takes at most "
                f"{self.max_video_seconds:g} s (--max-video-seconds)"
            )
        if frames is not None and frames > self.max_video_frames:
            raise over_limit(
                f"the video has {frames} frames; this server decodes at most "
                f"{self.max_video_frames} (--max-video-frames)"
            )
