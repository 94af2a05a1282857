"""One entry point: bytes and the modality they were sent as -> the decoded dataclass."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from inferd.media.limits import MediaError, MediaLimits
from inferd.media.types import DecodedMedia

if TYPE_CHECKING:
    from inferd.media.video import FrameSampling


def decode_media(
    data: bytes,
    modality: str,
    limits: MediaLimits | None = None,
    declared: str | None = None,
    *,
    audio_rate: int | None = None,
    video_sampling: FrameSampling | None = None,
    video_audio: bool = False,
) -> DecodedMedia:
    """Decode ``data`` sent as ``modality`` (image, audio or video); MediaError on failure.

    ``declared`` is the media type the sender gave, checked against the bytes; ``audio_rate``
    resamples audio to a model's rate (a video's sound too); ``video_sampling`` picks the
    frames (a model's own, or ``VideoSampling``); ``video_audio`` adds the first audio track.
    """
    if modality == "image":
        from inferd.media.image import decode_image

        return decode_image(data, limits, declared)
    if modality == "audio":
        from inferd.media.audio import decode_audio

        audio = decode_audio(data, limits, declared)
        return audio.resampled(audio_rate) if audio_rate else audio
    if modality == "video":
        from inferd.media.video import decode_video

        video = decode_video(data, limits, declared, video_sampling, with_audio=video_audio)
        if video.audio is not None and audio_rate:
            return replace(video, audio=video.audio.resampled(audio_rate))
        return video
    raise MediaError(f"{modality} media is not decoded by this server")
