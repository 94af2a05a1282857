"""Gemma 4's videos: which frames its video processor keeps and how each is prepared and
written in the prompt, as transformers' Gemma4VideoProcessor and Gemma4Processor do it.

The processor keeps ``num_frames`` frames (32 by default) evenly over the stream,
``i * total // num_frames``; a stream with fewer frames keeps them all (transformers refuses
it instead). Each kept frame is an image prepared at the video processor's own soft-token
budget (70 by default, against 280 for an image) and encoded by the image encoder on its own;
in the prompt the video token the chat template writes becomes, per frame, its time as
``mm:ss`` (the frame's index over the stream's rate, 24 when the stream does not say) and the
frame's ``boi`` + video tokens + ``eoi`` (``gemma4_image.video_prompt_text``).

Frames are resized with Pillow's bicubic, as images are; transformers' video processor resizes
with torchvision's antialiased bicubic, so a frame that needs resizing may differ from its
pixels in the last bits (frames already of the target size are the same).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from inferd.models.gemma4_image import Gemma4ImageConfig, PreparedGemma4Image, video_prompt_text

UNKNOWN_FPS = 24.0  # what the processor assumes of a stream that does not say
DEFAULT_FRAMES = 32
DEFAULT_VIDEO_SOFT_TOKENS = 70


@dataclass(frozen=True, slots=True)
class Gemma4VideoConfig:
    """The video processor's settings; a ``media.video.FrameSampling``."""

    frames: Gemma4ImageConfig  # how each kept frame is prepared (the video token budget)
    video_token: str  # what the chat template writes and the encoder's rows replace
    num_frames: int = DEFAULT_FRAMES

    @classmethod
    def from_hf(
        cls, settings: Mapping[str, Any], tokens: tuple[str, str, str], video_token: str
    ) -> Gemma4VideoConfig:
        """From the video processor's settings (its defaults where they say nothing), the
        tokenizer's (image, boi, eoi) tokens and its video token."""
        settings = {"max_soft_tokens": DEFAULT_VIDEO_SOFT_TOKENS, **settings}
        if settings.get("do_sample_frames") is False:
            raise ValueError("a Gemma 4 video processor that samples no frames is not supported")
        if settings.get("fps") is not None:
            raise ValueError("a Gemma 4 video processor sampling by fps is not supported")
        frames = Gemma4ImageConfig.from_hf(settings, tokens)
        count = int(settings.get("num_frames") or DEFAULT_FRAMES)
        if count < 1:
            raise ValueError(f"num_frames {count} must be at least 1")
        return cls(frames, video_token, count)

    def indices(self, total: int, duration: float, fps: float = 0.0) -> list[int]:
        """Which of ``total`` frames to keep (the stream's ``duration`` and rate are not
        needed: the count is fixed)."""
        n = min(self.num_frames, total)
        return [i * total // n for i in range(n)] if n > 0 else []

    def prepare(self, frames: np.ndarray) -> list[PreparedGemma4Image]:
        """Each kept frame ([n, height, width, 3] RGB) as the encoder takes it."""
        return [self.frames.prepare(Image.fromarray(frame)) for frame in frames]

    def prompt_text(self, indices: Sequence[int], fps: float, soft_tokens: int) -> str:
        """The video's text in the prompt: each kept frame's time and tokens."""
        rate = fps if fps > 0 else UNKNOWN_FPS
        seconds = [i / rate for i in indices]
        return video_prompt_text(self.frames, self.video_token, seconds, soft_tokens)
