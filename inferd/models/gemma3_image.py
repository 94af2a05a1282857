"""Gemma 3 image preprocessing on Pillow and numpy: what transformers' Gemma3 processor does to
an image with pan-and-scan off (its default), and the prompt text that stands for it.

An image is made RGB, resized to exactly ``size`` (the encoder's square, aspect not kept;
bilinear by default), rescaled to [0, 1] and normalized, in the steps and dtypes of
models/idefics3_image.py's ``PixelNormalizer``: one tile per image, bit for bit the processor's.

In the prompt, each ``<start_of_image>`` the chat template writes becomes
``\\n\\n<start_of_image>`` + ``<image_soft_token>`` * mm_tokens_per_image +
``<end_of_image>\\n\\n``; the encoder's rows replace the soft tokens in order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from inferd.models.idefics3_image import ImageConfigError, PixelNormalizer, to_rgb

BOI_TOKEN = "<start_of_image>"  # what the chat template writes where an image goes
SOFT_TOKEN = "<image_soft_token>"  # the placeholder the encoder's rows replace
EOI_TOKEN = "<end_of_image>"
AROUND = "\n\n"  # the processor surrounds each image's tokens with a blank line


@dataclass(frozen=True, slots=True)
class Gemma3ImageConfig:
    height: int
    width: int
    image_seq_len: int  # soft tokens per image (mm_tokens_per_image)
    do_resize: bool = True
    resample: int = Image.Resampling.BILINEAR
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    marker: str = BOI_TOKEN

    @classmethod
    def from_hf(cls, settings: Mapping[str, Any], image_seq_len: int) -> Gemma3ImageConfig:
        """From the image processor's settings (``preprocessor_config.json``, or the
        ``image_processor`` object of ``processor_config.json``)."""
        if settings.get("do_pan_and_scan"):
            raise ImageConfigError("pan-and-scan (do_pan_and_scan: true) is not supported")
        size = settings.get("size") or {}
        if not isinstance(size, Mapping) or "height" not in size or "width" not in size:
            raise ImageConfigError("the Gemma 3 image processor's size needs height and width")
        mean = tuple(float(v) for v in settings.get("image_mean") or (0.5, 0.5, 0.5))
        std = tuple(float(v) for v in settings.get("image_std") or (0.5, 0.5, 0.5))
        if len(mean) != 3 or len(std) != 3:
            raise ImageConfigError("image_mean and image_std need three values (RGB)")

        def flag(name: str) -> bool:
            value = settings.get(name)
            return True if value is None else bool(value)

        resample = settings.get("resample")
        return cls(
            height=int(size["height"]),
            width=int(size["width"]),
            image_seq_len=image_seq_len,
            do_resize=flag("do_resize"),
            resample=int(Image.Resampling.BILINEAR if resample is None else resample),
            rescale_factor=float(settings.get("rescale_factor") or 1 / 255),
            do_rescale=flag("do_rescale"),
            do_normalize=flag("do_normalize"),
            mean=(mean[0], mean[1], mean[2]),
            std=(std[0], std[1], std[2]),
        )

    @property
    def tile(self) -> int:
        """The encoder's square side (the processor's size, checked square on load)."""
        return self.height

    def prepare(self, image: Image.Image) -> PreparedGemma3Image:
        return prepare_image(image, self)


@dataclass(frozen=True, slots=True)
class PreparedGemma3Image:
    """One image as the encoder takes it (bytes until it runs: ``pixel_values``)."""

    tiles: torch.Tensor  # [1, 3, H, W] uint8
    normalizer: PixelNormalizer
    image_seq_len: int

    @property
    def pixel_values(self) -> torch.Tensor:
        return self.normalizer(self.tiles)

    @property
    def num_embeddings(self) -> int:
        return self.image_seq_len

    def prompt_text(self) -> str:
        """The text of the image's tokens, without the blank lines around them (the prompter
        puts those into the neighbouring text, where the tokenizer merges newlines)."""
        return BOI_TOKEN + SOFT_TOKEN * self.image_seq_len + EOI_TOKEN


def prepare_image(image: Image.Image, cfg: Gemma3ImageConfig) -> PreparedGemma3Image:
    """The encoder's input for one image (any mode: made RGB first, see ``to_rgb``)."""
    image = to_rgb(image)
    if cfg.do_resize:
        image = image.resize((cfg.width, cfg.height), resample=Image.Resampling(cfg.resample))
    pixels = np.asarray(image).transpose(2, 0, 1)[None].copy()
    normalizer = PixelNormalizer(
        cfg.rescale_factor if cfg.do_rescale else None,
        cfg.mean if cfg.do_normalize else None,
        cfg.std if cfg.do_normalize else None,
    )
    return PreparedGemma3Image(torch.from_numpy(pixels), normalizer, cfg.image_seq_len)
