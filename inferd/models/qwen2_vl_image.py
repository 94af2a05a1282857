"""Qwen2-VL / Qwen2.5-VL image and video preprocessing: what transformers' Qwen2-VL image
processor (Pillow) and video processor (torch) do, and the prompt text that stands for each.

An image is made RGB, resized (bicubic, Pillow) to ``smart_resize``'s size: both sides whole
multiples of ``patch * merge`` (28 px), the area within ``[min_pixels, max_pixels]``, the aspect
kept as closely as that allows. It is rescaled to [0, 1] (float64, then float32) and normalized,
repeated ``temporal_patch_size`` times, and cut into patches ordered merge group by merge group
(each 2x2 group's patches consecutive), each flattened as (channel, time, row, col): the
encoder's ``[t * h * w, C * T * P * P]`` with grid ``(1, h, w)`` in patches.

A video's sampled frames (at least ``temporal_patch_size``, a multiple of it: the last repeated)
are resized together to one ``smart_resize`` size, bicubic with antialiasing on the bytes (what
torchvision does to a byte tensor on the CPU), rescaled and normalized in one
step (``(x - 255 * mean) / (255 * std)``), then cut the same way, consecutive frame pairs
being one temporal patch: grid ``(frames / 2, h, w)``; ``seconds_per_grid`` (the temporal
patch's duration) sets its temporal positions.

Each becomes ``t * h * w / merge^2`` ``<|image_pad|>`` (``<|video_pad|>``) tokens between the
``<|vision_start|>`` and ``<|vision_end|>`` the chat template writes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from inferd.models.idefics3_image import ImageConfigError, PixelNormalizer, to_rgb

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT = 200


@dataclass(frozen=True, slots=True)
class QwenVisualConfig:
    """An image or a video processor's settings."""

    min_pixels: int
    max_pixels: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD

    @classmethod
    def from_hf(
        cls, settings: Mapping[str, Any], default_pixels: tuple[int, int]
    ) -> QwenVisualConfig:
        """From ``preprocessor_config.json`` (or the video processor's): pixel bounds under
        ``size`` (``shortest_edge``/``longest_edge``) or as ``min_pixels``/``max_pixels``."""
        size = settings.get("size") or {}
        if not isinstance(size, Mapping):
            raise ImageConfigError("the processor's size must be an object")
        low = settings.get("min_pixels") or size.get("shortest_edge") or default_pixels[0]
        high = settings.get("max_pixels") or size.get("longest_edge") or default_pixels[1]
        mean = tuple(float(v) for v in settings.get("image_mean", CLIP_MEAN))
        std = tuple(float(v) for v in settings.get("image_std", CLIP_STD))
        if len(mean) != 3 or len(std) != 3:
            raise ImageConfigError("image_mean and image_std need three values (RGB)")
        if int(settings.get("resample", 3)) != Image.Resampling.BICUBIC:
            raise ImageConfigError("only bicubic resampling is supported")
        cfg = cls(
            min_pixels=int(low),
            max_pixels=int(high),
            patch_size=int(settings.get("patch_size", 14)),
            temporal_patch_size=int(settings.get("temporal_patch_size", 2)),
            merge_size=int(settings.get("merge_size", 2)),
            do_resize=bool(settings.get("do_resize", True)),
            do_rescale=bool(settings.get("do_rescale", True)),
            rescale_factor=float(settings.get("rescale_factor", 1 / 255)),
            do_normalize=bool(settings.get("do_normalize", True)),
            mean=(mean[0], mean[1], mean[2]),
            std=(std[0], std[1], std[2]),
        )
        if not 0 < cfg.min_pixels <= cfg.max_pixels:
            raise ImageConfigError("the processor's pixel bounds are out of order")
        return cfg

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def smart_resize(height: int, width: int, cfg: QwenVisualConfig) -> tuple[int, int]:
    """The size an image is resized to (transformers' ``smart_resize``, same arithmetic)."""
    factor = cfg.factor
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ImageConfigError(f"an image's aspect ratio must be under {MAX_ASPECT}")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > cfg.max_pixels:
        beta = math.sqrt(height * width / cfg.max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < cfg.min_pixels:
        beta = math.sqrt(cfg.min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def patchify(frames: torch.Tensor, cfg: QwenVisualConfig) -> torch.Tensor:
    """[frames, C, H, W] float (frames a multiple of the temporal patch) -> the encoder's
    ``[t * h * w, C * T * P * P]``, merge groups consecutive."""
    f, c, height, width = frames.shape
    t, p, m = cfg.temporal_patch_size, cfg.patch_size, cfg.merge_size
    gt, gh, gw = f // t, height // p, width // p
    x = frames.reshape(gt, t, c, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (t, gh, gw, mh, mw, C, T, ph, pw)
    return x.reshape(gt * gh * gw, c * t * p * p)


@dataclass(frozen=True, slots=True)
class PreparedVisual:
    """One image or video as the encoder takes it. Its pixels stay bytes (a quarter of the
    floats' memory) until the encoder runs: ``patches``."""

    pixels: torch.Tensor  # [frames, 3, H, W] uint8, resized; frames a multiple of T
    cfg: QwenVisualConfig
    modality: str  # "image" | "video"
    seconds_per_grid: float = 0.0  # video: the duration of one temporal patch

    @property
    def grid(self) -> tuple[int, int, int]:
        f, _, h, w = self.pixels.shape
        p = self.cfg.patch_size
        return f // self.cfg.temporal_patch_size, h // p, w // p

    @property
    def num_embeddings(self) -> int:
        t, h, w = self.grid
        return t * h * w // self.cfg.merge_size**2

    @property
    def patches(self) -> torch.Tensor:
        return visual_patches(self.pixels, self.cfg, self.modality)

    def prompt_text(self) -> str:
        return (IMAGE_PAD if self.modality == "image" else VIDEO_PAD) * self.num_embeddings


def visual_patches(pixels: torch.Tensor, cfg: QwenVisualConfig, modality: str) -> torch.Tensor:
    """Resized bytes [frames, 3, H, W] -> the encoder's float32 patches."""
    if modality == "image":
        normalize = PixelNormalizer(
            cfg.rescale_factor if cfg.do_rescale else None,
            cfg.mean if cfg.do_normalize else None,
            cfg.std if cfg.do_normalize else None,
        )
        return patchify(normalize(pixels), cfg)
    x = pixels.float()
    if cfg.do_normalize:
        # The video processor folds the rescale into the mean and std (one step).
        scale = 1.0 / cfg.rescale_factor if cfg.do_rescale else 1.0
        mean = torch.tensor(cfg.mean) * scale
        std = torch.tensor(cfg.std) * scale
        x = (x - mean[:, None, None]) / std[:, None, None]
    elif cfg.do_rescale:
        x = x * cfg.rescale_factor
    return patchify(x, cfg)


def image_tokens(width: int, height: int, cfg: QwenVisualConfig) -> int:
    """The ``<|image_pad|>`` tokens an upright ``width`` x ``height`` image stands for, from
    its size alone (``prepare_image``'s grid: one temporal patch)."""
    if cfg.do_resize:
        height, width = smart_resize(height, width, cfg)
    return (height // cfg.patch_size) * (width // cfg.patch_size) // cfg.merge_size**2


def prepare_image(image: Image.Image, cfg: QwenVisualConfig) -> PreparedVisual:
    """One image (any mode: made RGB first)."""
    image = to_rgb(image)
    if cfg.do_resize:
        height, width = smart_resize(image.height, image.width, cfg)
        image = image.resize((width, height), resample=Image.Resampling.BICUBIC)
    if image.height % cfg.factor or image.width % cfg.factor:
        raise ImageConfigError(f"the image's sides must be multiples of {cfg.factor} px")
    pixels = torch.from_numpy(np.asarray(image).transpose(2, 0, 1).copy())
    frames = pixels[None].expand(cfg.temporal_patch_size, -1, -1, -1).contiguous()
    return PreparedVisual(frames, cfg, "image")


def resize_frames(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[n, 3, H, W] uint8 -> bicubic with antialiasing, on the bytes: what torchvision's
    resize does to a byte tensor on the CPU (torch's native uint8 kernel, whose results differ
    from resizing floats and rounding)."""
    if frames.shape[-2:] == (height, width):
        return frames
    return F.interpolate(
        frames, size=(height, width), mode="bicubic", align_corners=False, antialias=True
    )


def prepare_video(frames: np.ndarray, sampled_fps: float, cfg: QwenVisualConfig) -> PreparedVisual:
    """Sampled RGB frames ``[n, H, W, 3]`` uint8, ``sampled_fps`` of them a second."""
    if frames.ndim != 4 or frames.shape[-1] != 3 or not len(frames):
        raise ImageConfigError("a video needs RGB frames")
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
    if cfg.do_resize:
        x = resize_frames(x, *smart_resize(x.shape[2], x.shape[3], cfg))
    if x.shape[2] % cfg.factor or x.shape[3] % cfg.factor:
        raise ImageConfigError(f"the video's sides must be multiples of {cfg.factor} px")
    t = cfg.temporal_patch_size
    if pad := -x.shape[0] % t:  # the last frame repeated to fill the temporal patch
        x = torch.cat((x, x[-1:].expand(pad, -1, -1, -1)))
    return PreparedVisual(x.contiguous(), cfg, "video", t / sampled_fps)
