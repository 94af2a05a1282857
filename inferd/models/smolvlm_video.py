"""SmolVLM2 video preprocessing on Pillow and numpy: what transformers' SmolVLMProcessor and
SmolVLMVideoProcessor do to a video, and the prompt text that stands for it.

Frames: ``min(max_frames, round(fps * duration))`` (at least one) indices spread evenly with
``linspace`` over the whole video, or over all but ``skip_secs`` at each end when the video is
long enough, duplicates dropped; ``duration`` is the frame count over the stream's frame rate,
as transformers' PyAV loader computes it. Each kept frame is resized so its long side is
``video_size`` (the short side even), then to one square tile (``max_image_size``): never split.
Its pixels are rescaled and normalized as an image tile's are.

Prompt: each ``<video>`` becomes an intro naming the frame count in words and the duration as
H:MM:SS, then per frame ``\\nFrame from MM:SS:`` (the frame's index over the frame rate) and
one image's tokens (``<fake_token_around_image><global-img><image>*seq<fake_token_around_image>``),
then a blank line. The encoder's output rows replace the frames' ``<image>`` tokens in order.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from PIL import Image

from inferd.models.idefics3_image import (
    MAX_IMAGE_SIDE,
    Idefics3ImageConfig,
    ImageConfigError,
    PixelNormalizer,
    expansion,
    normalizer,
)

VIDEO_TOKEN = "<video>"  # what SmolVLM2's chat template writes where a video goes
INTRO = (
    "You are provided the following series of {count} frames from a {duration} [H:MM:SS] video.\n"
)
FRAME = "\nFrame from {stamp}:"
OUTRO = "\n\n"


@dataclass(frozen=True, slots=True)
class SmolVLMVideoConfig:
    fps: float  # frames kept per second of video
    max_frames: int  # at most this many
    longest_edge: int  # video_size: the first resize's long side
    image: Idefics3ImageConfig  # the tile side, tokens per tile, rescale and normalization
    skip_secs: float = 1.0  # skipped at each end of a long video (transformers' default)

    @classmethod
    def from_hf(cls, settings: Mapping[str, Any], image: Idefics3ImageConfig) -> SmolVLMVideoConfig:
        """From the video processor's settings: ``video_sampling`` (``fps``, ``max_frames``,
        ``video_size``) as the published checkpoints' ``preprocessor_config.json`` has it, or
        transformers' ``fps``/``num_frames``/``size`` keys of a saved video processor. The
        tile and normalization come from the image settings unless the video's say otherwise."""
        sampling = settings.get("video_sampling") or {}
        if not isinstance(sampling, Mapping):
            raise ImageConfigError("video_sampling must be an object")
        fps = sampling.get("fps", settings.get("fps"))
        frames = sampling.get("max_frames", settings.get("num_frames"))
        size = sampling.get("video_size", settings.get("size")) or {}
        if fps is None or frames is None or not isinstance(size, Mapping):
            raise ImageConfigError("the video processor settings name no fps, frames or size")
        tile = (settings.get("max_image_size") or {}).get("longest_edge", image.tile)
        if int(tile) != image.tile:
            raise ImageConfigError(f"video frames of {tile} px, the encoder takes {image.tile}")
        return cls(
            fps=float(fps),
            max_frames=int(frames),
            longest_edge=int(size.get("longest_edge", image.longest_edge)),
            image=image,
        )

    def indices(self, total: int, duration: float, fps: float = 0.0) -> list[int]:
        """Which of ``total`` frames to keep (``media.video``'s sampling interface); the
        duration is ``total / fps`` as transformers computes it, not the declared one."""
        return sample_indices(total, fps, self)


def sample_indices(total: int, rate: float, cfg: SmolVLMVideoConfig) -> list[int]:
    """transformers' SmolVLMVideoProcessor.sample_frames, step by step."""
    duration = total / rate if rate else 0.0
    wanted = max(1, min(round(cfg.fps * duration), cfg.max_frames))
    start, end = 0, total - 1
    if cfg.skip_secs > 0 and duration - 2 * cfg.skip_secs > cfg.max_frames * cfg.fps:
        start, end = int(cfg.skip_secs * rate), int(total - cfg.skip_secs * rate)
    start, end = max(0, start), min(end, total - 1)
    if start >= end:
        start, end = 0, total - 1
    return [int(i) for i in np.unique(np.linspace(start, end, wanted, dtype=int))]


@dataclass(frozen=True, slots=True)
class PreparedVideo:
    """One video as the encoder takes it (one tile per frame) and its place in the prompt."""

    tiles: torch.Tensor  # [frames, 3, tile, tile] uint8
    normalizer: PixelNormalizer
    timestamps: tuple[float, ...]  # seconds, of the kept frames
    duration: float  # seconds, the frame count over the frame rate
    image_seq_len: int

    @property
    def pixel_values(self) -> torch.Tensor:
        return self.normalizer(self.tiles)

    @property
    def num_embeddings(self) -> int:
        return self.tiles.shape[0] * self.image_seq_len

    def prompt_text(self) -> str:
        return video_prompt(self.timestamps, self.duration, self.image_seq_len)


def video_prompt(timestamps: tuple[float, ...], duration: float, image_seq_len: int) -> str:
    """The text that replaces one ``<video>`` in the prompt (transformers' layout exactly)."""
    length = str(datetime.timedelta(seconds=int(duration)))
    text = INTRO.format(count=number_words(len(timestamps)), duration=length)
    frame = expansion(0, 0, image_seq_len)
    for second in timestamps:
        stamp = f"{int(second // 60):02d}:{int(second % 60):02d}"
        text += FRAME.format(stamp=stamp) + frame
    return text + OUTRO


def prepare_video(
    frames: npt.NDArray[np.uint8],
    indices: tuple[int, ...],
    rate: float,
    total: int,
    cfg: SmolVLMVideoConfig,
) -> PreparedVideo:
    """The encoder's tiles for the sampled ``frames`` ([n, h, w, 3] RGB) of a video of
    ``total`` frames at ``rate`` frames per second; ``indices`` are theirs among all frames."""
    image = cfg.image
    height, width = _long_side(int(frames.shape[1]), int(frames.shape[2]), cfg.longest_edge)
    tiles = []
    for frame in frames:
        picture = Image.fromarray(frame)
        if image.do_resize:
            picture = picture.resize((width, height), resample=Image.Resampling(image.resample))
            picture = picture.resize(
                (image.tile, image.tile), resample=Image.Resampling(image.resample)
            )
        tiles.append(np.asarray(picture).transpose(2, 0, 1))
    return PreparedVideo(
        torch.from_numpy(np.stack(tiles)),
        normalizer(image),
        tuple(i / rate for i in indices),
        total / rate,
        image.image_seq_len,
    )


def _long_side(height: int, width: int, long_side: int) -> tuple[int, int]:
    """The video processor's first size: long side to ``long_side`` (at most 4096), the short
    side truncated then made even."""
    long_side = min(MAX_IMAGE_SIDE, long_side)
    aspect = width / height
    if width >= height:
        width, height = long_side, int(long_side / aspect)
        height += height % 2
    else:
        height, width = long_side, int(long_side * aspect)
        width += width % 2
    return max(height, 1), max(width, 1)


_ONES = [
    *("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"),
    *("eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen"),
    *("eighteen", "nineteen"),
]
_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def number_words(n: int) -> str:
    """An English cardinal as the processor writes the frame count (num2words' style:
    "twenty-one", "one hundred and five", "two thousand, three hundred and one")."""
    if n < 0 or n >= 1_000_000:
        raise ValueError(f"frame count {n} out of range")
    if n >= 1000:
        thousands, rest = divmod(n, 1000)
        head = f"{number_words(thousands)} thousand"
        if rest == 0:
            return head
        return f"{head}{',' if rest >= 100 else ' and'} {number_words(rest)}"
    if n >= 100:
        hundreds, rest = divmod(n, 100)
        head = f"{_ONES[hundreds]} hundred"
        return head if rest == 0 else f"{head} and {number_words(rest)}"
    if n >= 20:
        tens, ones = divmod(n, 10)
        return _TENS[tens] if ones == 0 else f"{_TENS[tens]}-{_ONES[ones]}"
    return _ONES[n]
