"""Qwen3-VL's videos: which frames its video processor keeps, the size it resizes them to, and
the prompt text with each temporal patch's timestamp, all as transformers' Qwen3-VL video
processor and processor do them; the pixels are prepared as Qwen2-VL's videos are
(models/qwen2_vl_image.py: bicubic with antialiasing on the bytes, one fused normalize step,
the last frame repeated to fill a temporal patch).

Frames are sampled at ``fps`` a second of the stream (its own rate, 24 when unknown), at least
``min_frames`` and at most ``max_frames`` (and never more than it has), evenly over the whole:
``round(linspace(0, total - 1, n))``. The size bounds ``size`` gives apply to all the frames
together (``t * h * w``), not to one. Each temporal patch becomes its own run in the prompt:
``<{seconds:.1f} seconds><|vision_start|>`` + one ``<|video_pad|>`` per merged patch of a frame +
``<|vision_end|>``, the seconds being the mean of its first and last frame's times; the run
stands where the chat template's ``<|video_pad|>`` stood (transformers v5 replaces that token
alone, so the template's own ``<|vision_start|>`` and ``<|vision_end|>`` stay around the whole).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from inferd.models.idefics3_image import ImageConfigError
from inferd.models.qwen2_vl_image import (
    MAX_ASPECT,
    VIDEO_PAD,
    PreparedVisual,
    QwenVisualConfig,
    resize_frames,
)

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
UNKNOWN_FPS = 24.0  # what the processor assumes of a stream that does not say
# transformers' Qwen3-VL video processor's pixel bounds (over all frames) and sampling.
QWEN3_VIDEO_PIXELS = (128 * 32 * 32, 32 * 32 * 768)
QWEN3_VIDEO_DEFAULTS = {"patch_size": 16, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}


@dataclass(frozen=True, slots=True)
class Qwen3VideoConfig:
    """The video processor's settings; a ``media.video.FrameSampling``."""

    visual: QwenVisualConfig  # pixel bounds over all frames, patches, normalization
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768

    @classmethod
    def from_hf(cls, settings: Mapping[str, Any]) -> Qwen3VideoConfig:
        if settings.get("cap_pixels_per_frame"):
            raise ImageConfigError("cap_pixels_per_frame is not supported")
        if settings.get("num_frames") is not None or settings.get("do_sample_frames") is False:
            raise ImageConfigError("only sampling by fps is supported")
        # The video processor's own defaults: 16 px patches, mean and std 0.5.
        settings = {**QWEN3_VIDEO_DEFAULTS, **settings}
        cfg = cls(
            QwenVisualConfig.from_hf(settings, QWEN3_VIDEO_PIXELS),
            fps=float(settings.get("fps") or 2.0),
            min_frames=int(settings.get("min_frames", 4)),
            max_frames=int(settings.get("max_frames", 768)),
        )
        if not cfg.fps > 0 or not 0 < cfg.min_frames <= cfg.max_frames:
            raise ImageConfigError("the video processor's fps and frame bounds are out of order")
        return cfg

    def indices(self, total: int, duration: float, fps: float = 0.0) -> list[int]:
        """Which of ``total`` frames the processor keeps (``fps``: the stream's rate)."""
        if total < 1:
            return []
        rate = fps if fps > 0 else UNKNOWN_FPS
        wanted = int(total / rate * self.fps)
        wanted = min(max(wanted, self.min_frames), self.max_frames, total)
        return np.linspace(0, total - 1, wanted).round().astype(int).tolist()


def video_size(frames: int, height: int, width: int, cfg: QwenVisualConfig) -> tuple[int, int]:
    """The size ``frames`` frames of ``height`` x ``width`` are resized to (the Qwen3-VL video
    processor's ``smart_resize``, same arithmetic: the bounds cover every frame)."""
    factor, t = cfg.factor, cfg.temporal_patch_size
    if frames < t:
        raise ImageConfigError(f"a video needs at least {t} frames")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ImageConfigError(f"a video's aspect ratio must be under {MAX_ASPECT}")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if round(frames / t) * t * h * w > cfg.max_pixels:
        beta = math.sqrt(frames * height * width / cfg.max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif round(frames / t) * t * h * w < cfg.min_pixels:
        beta = math.sqrt(cfg.min_pixels / (frames * height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def timestamps(indices: Sequence[int], fps: float, temporal: int) -> list[float]:
    """Each temporal patch's time in seconds: the mean of its first and last frame's (the
    last index repeated to fill the last patch, as the frames are)."""
    rate = fps if fps > 0 else UNKNOWN_FPS
    padded = list(indices) + [indices[-1]] * (-len(indices) % temporal)
    times = [i / rate for i in padded]
    return [(times[i] + times[i + temporal - 1]) / 2 for i in range(0, len(times), temporal)]


@dataclass(frozen=True, slots=True)
class PreparedQwen3Video:
    """A video as the encoder takes it (all its temporal patches), and the times of each."""

    visual: PreparedVisual  # grid (t, h, w)
    seconds: tuple[float, ...]  # one per temporal patch

    @property
    def frame_tokens(self) -> int:
        """Placeholders of one temporal patch (a run in the prompt)."""
        _, h, w = self.visual.grid
        return h * w // self.visual.cfg.merge_size**2

    def runs(self) -> list[PreparedVisual]:
        """Each temporal patch on its own (grid t = 1): the encoder gives the same rows for
        it alone, since its blocks attend within a frame."""
        t = self.visual.cfg.temporal_patch_size
        pixels = self.visual.pixels
        return [
            PreparedVisual(pixels[i : i + t], self.visual.cfg, "video")
            for i in range(0, pixels.shape[0], t)
        ]

    def prompt_text(self) -> str:
        """What stands for the chat template's ``<|video_pad|>``."""
        run = VISION_START + VIDEO_PAD * self.frame_tokens + VISION_END
        return "".join(f"<{s:.1f} seconds>" + run for s in self.seconds)


def prepare_video(
    frames: np.ndarray, indices: Sequence[int], fps: float, cfg: Qwen3VideoConfig
) -> PreparedQwen3Video:
    """Sampled RGB frames ``[n, H, W, 3]`` uint8, their ``indices`` in the stream and the
    stream's ``fps`` (0: unknown)."""
    if frames.ndim != 4 or frames.shape[-1] != 3 or not len(frames):
        raise ImageConfigError("a video needs RGB frames")
    if len(indices) != len(frames):
        raise ImageConfigError("a video needs one index per sampled frame")
    visual = cfg.visual
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
    if visual.do_resize:
        x = resize_frames(x, *video_size(x.shape[0], x.shape[2], x.shape[3], visual))
    if x.shape[2] % visual.factor or x.shape[3] % visual.factor:
        raise ImageConfigError(f"the video's sides must be multiples of {visual.factor} px")
    t = visual.temporal_patch_size
    if pad := -x.shape[0] % t:  # the last frame repeated to fill the temporal patch
        x = torch.cat((x, x[-1:].expand(pad, -1, -1, -1)))
    prepared = PreparedVisual(x.contiguous(), visual, "video")
    return PreparedQwen3Video(prepared, tuple(timestamps(indices, fps, t)))
