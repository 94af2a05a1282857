"""Gemma 4 image preprocessing on Pillow and numpy: what transformers' Gemma4 image processor
does to an image, and the prompt text that stands for it.

An image is made RGB and resized, keeping its aspect, to the largest size whose sides are
multiples of ``pooling * patch`` pixels and which holds at most ``max_soft_tokens * pooling^2``
patches (bicubic; no resize when it already has that size); rescaled to [0, 1] (no
normalization: the encoder maps pixels to [-1, 1] itself) and cut into ``patch x patch``
patches, row by row, each flattened as (row, column, channel); each patch keeps its (x, y)
place in the grid. Bit for bit the processor's, without its padding to ``max_patches``.

In the prompt, the image token the chat template writes becomes ``boi`` + one image token
per soft token (patches / pooling^2) + ``eoi``; the encoder's rows replace the image tokens.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from inferd.models.idefics3_image import ImageConfigError, PixelNormalizer, to_rgb

# The soft-token budgets the processor accepts (transformers refuses others).
SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)


@dataclass(frozen=True, slots=True)
class Gemma4ImageConfig:
    patch_size: int
    pooling: int  # pooling_kernel_size
    max_soft_tokens: int
    image_token: str  # what the template writes and the encoder's rows replace
    boi_token: str
    eoi_token: str
    resample: int = Image.Resampling.BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255

    def __post_init__(self) -> None:
        if self.max_soft_tokens not in SUPPORTED_SOFT_TOKENS:
            raise ImageConfigError(
                f"max_soft_tokens {self.max_soft_tokens} is not one of {SUPPORTED_SOFT_TOKENS}"
            )

    @classmethod
    def from_hf(
        cls, settings: Mapping[str, Any], tokens: tuple[str, str, str]
    ) -> Gemma4ImageConfig:
        """From the image processor's settings (``processor_config.json``'s
        ``image_processor``) and the tokenizer's (image, boi, eoi) tokens."""
        # The video processor normalizes by mean 0 and std 1, which changes nothing.
        identity = (
            list(settings.get("image_mean") or [0.0] * 3) == [0.0] * 3
            and list(settings.get("image_std") or [1.0] * 3) == [1.0] * 3
        )
        if settings.get("do_normalize") and not identity:
            raise ImageConfigError("a Gemma 4 image processor that normalizes is not supported")
        resample = settings.get("resample")

        def flag(name: str) -> bool:
            value = settings.get(name)
            return True if value is None else bool(value)

        return cls(
            patch_size=int(settings.get("patch_size") or 16),
            pooling=int(settings.get("pooling_kernel_size") or 3),
            max_soft_tokens=int(settings.get("max_soft_tokens") or 280),
            image_token=tokens[0],
            boi_token=tokens[1],
            eoi_token=tokens[2],
            resample=int(Image.Resampling.BICUBIC if resample is None else resample),
            do_resize=flag("do_resize"),
            do_rescale=flag("do_rescale"),
            rescale_factor=float(settings.get("rescale_factor") or 1 / 255),
        )

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling**2

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) an image of this size is resized to."""
        budget = self.max_patches * self.patch_size**2
        factor = math.sqrt(budget / (height * width))
        side = self.pooling * self.patch_size
        h = math.floor(factor * height / side) * side
        w = math.floor(factor * width / side) * side
        longest = (self.max_patches // self.pooling**2) * side
        if h == 0 and w == 0:
            raise ImageConfigError(f"a {width}x{height} image is too small to encode")
        if h == 0:  # a very wide image: one row of pooled cells
            h, w = side, min(math.floor(width / height) * side, longest)
        elif w == 0:
            w, h = side, min(math.floor(height / width) * side, longest)
        if h * w > budget:
            raise ImageConfigError(f"a {width}x{height} image exceeds {self.max_patches} patches")
        return h, w

    def num_soft_tokens(self, height: int, width: int) -> int:
        """Soft tokens of an image of this size (the processor's count)."""
        h, w = self.target_size(height, width) if self.do_resize else (height, width)
        return (h // self.patch_size) * (w // self.patch_size) // self.pooling**2

    def prepare(self, image: Image.Image) -> PreparedGemma4Image:
        return prepare_image(image, self)


@dataclass(frozen=True, slots=True)
class PreparedGemma4Image:
    """One image as the encoder takes it."""

    patches: torch.Tensor  # [patches, patch * patch * 3] float32 in [0, 1]
    positions: torch.Tensor  # [patches, 2] long: each patch's (x, y) in the grid
    num_soft_tokens: int
    cfg: Gemma4ImageConfig

    @property
    def num_embeddings(self) -> int:
        return self.num_soft_tokens

    def prompt_text(self) -> str:
        c = self.cfg
        return c.boi_token + c.image_token * self.num_soft_tokens + c.eoi_token


def patchify(pixels: np.ndarray, patch: int) -> tuple[np.ndarray, np.ndarray]:
    """[3, H, W] -> patches [(H / p) * (W / p), p * p * 3] row by row, and their (x, y)."""
    channels, height, width = pixels.shape
    rows, cols = height // patch, width // patch
    grid = pixels.reshape(channels, rows, patch, cols, patch).transpose(1, 3, 2, 4, 0)
    xs, ys = np.meshgrid(np.arange(cols), np.arange(rows), indexing="xy")
    return grid.reshape(rows * cols, -1), np.stack([xs, ys], axis=-1).reshape(rows * cols, 2)


def prepare_image(image: Image.Image, cfg: Gemma4ImageConfig) -> PreparedGemma4Image:
    """The encoder's input for one image (any mode: made RGB first, see ``to_rgb``)."""
    image = to_rgb(image)
    if cfg.do_resize:
        height, width = cfg.target_size(image.height, image.width)
        if (height, width) != (image.height, image.width):
            image = image.resize((width, height), resample=Image.Resampling(cfg.resample))
    tiles = torch.from_numpy(np.asarray(image).transpose(2, 0, 1)[None].copy())
    normalizer = PixelNormalizer(cfg.rescale_factor if cfg.do_rescale else None, None, None)
    pixels = normalizer(tiles)[0].numpy()
    if pixels.shape[1] % cfg.patch_size or pixels.shape[2] % cfg.patch_size:
        raise ImageConfigError(f"image sides {pixels.shape[1:]} are not whole patches")
    patches, positions = patchify(pixels, cfg.patch_size)
    soft = patches.shape[0] // cfg.pooling**2
    return PreparedGemma4Image(
        torch.from_numpy(np.ascontiguousarray(patches)), torch.from_numpy(positions), soft, cfg
    )


def video_prompt_text(
    cfg: Gemma4ImageConfig, video_token: str, timestamps: Sequence[float], soft_tokens: int
) -> str:
    """The text of a video's frames, as the processor writes it for its video token: per
    kept frame, its time as ``mm:ss`` (whole seconds, truncated), a space, and the frame's
    ``boi`` + ``soft_tokens`` video tokens + ``eoi``; frames apart by one space. Each frame's
    patches go through the image encoder as an image's do (``prepare`` at the video
    processor's token budget)."""
    frames = (
        f"{int(t // 60):02d}:{int(t % 60):02d} "
        + cfg.boi_token
        + video_token * soft_tokens
        + cfg.eoi_token
        for t in timestamps
    )
    return " ".join(frames)
