"""What decoding produces: one dataclass per modality, each carrying the digest of its source.

``digest`` is the hex SHA-256 of the bytes as received (before decoding), so two requests that
send the same file share it whatever the URL was: the key an encoder cache or a prefix cache
can use.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from PIL import Image


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True, slots=True)
class DecodedImage:
    image: Image.Image = field(repr=False)  # mode RGB, EXIF orientation applied
    digest: str
    format: str  # the sniffed format: "PNG", "JPEG", ...
    original_size: tuple[int, int]  # (width, height) as stored, before the EXIF rotation
    original_mode: str  # Pillow's mode before the RGB conversion: "RGBA", "L", "I;16", ...

    modality = "image"

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) of ``image``, upright."""
        return self.image.size


@dataclass(frozen=True, slots=True)
class DecodedAudio:
    samples: npt.NDArray[np.float32] = field(repr=False)  # [channels, n] in [-1, 1]
    sample_rate: int
    digest: str
    format: str  # "WAV", "FLAC", "MP4", ...

    modality = "audio"

    @property
    def channels(self) -> int:
        return int(self.samples.shape[0])

    @property
    def num_samples(self) -> int:
        return int(self.samples.shape[1])

    @property
    def duration(self) -> float:
        return self.num_samples / self.sample_rate

    def mono(self) -> npt.NDArray[np.float32]:
        """[n]: the mean of the channels (librosa's and transformers' down-mix)."""
        if self.channels == 1:
            return self.samples[0]
        return self.samples.mean(axis=0, dtype=np.float32)

    def resampled(self, rate: int) -> DecodedAudio:
        """The same audio at ``rate`` Hz (``inferd.media.resample`` says how)."""
        if rate == self.sample_rate:
            return self
        from inferd.media.resample import resample

        return replace(
            self, samples=resample(self.samples, self.sample_rate, rate), sample_rate=rate
        )


@dataclass(frozen=True, slots=True)
class DecodedVideo:
    frames: npt.NDArray[np.uint8] = field(repr=False)  # [n, height, width, 3] RGB, sampled
    frame_indices: tuple[int, ...]  # of the sampled frames among all the stream's frames
    timestamps: tuple[float, ...]  # seconds, of the sampled frames (their presentation times)
    fps: float  # the stream's average frame rate
    total_frames: int  # frames in the stream
    duration: float  # seconds
    digest: str
    format: str  # the container: "MP4", "WebM/Matroska", ...
    audio: DecodedAudio | None = None  # the first audio track, when asked for and present

    modality = "video"

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) of the frames."""
        return int(self.frames.shape[2]), int(self.frames.shape[1])

    def images(self) -> list[Image.Image]:
        """The sampled frames as RGB PIL images."""
        from PIL import Image

        return [Image.fromarray(frame) for frame in self.frames]


DecodedMedia = DecodedImage | DecodedAudio | DecodedVideo
