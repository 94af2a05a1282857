"""Idefics3 (SmolVLM) image preprocessing on Pillow and numpy: what transformers' Idefics3
processor does to an image, and the prompt text that stands for it.

An image is resized so its long side is ``longest_edge`` (up or down, aspect kept, the short side
even), then up to whole multiples of the tile size (``max_image_size``); an image larger than one
tile is cut into ``rows x cols`` tiles, row by row, followed by the whole image resized to one
tile (the global view). Each tile is rescaled to [0, 1] (in float64, then float32, as
transformers does) and normalized by the mean and std. Every tile is square and exactly one tile
in size, so the encoder sees no padding.

In the prompt, each ``<image>`` becomes, per tile, ``<fake_token_around_image><row_r_col_c>``
followed by ``image_seq_len`` ``<image>`` tokens (a newline after each row), then the global
view: a newline, ``<fake_token_around_image><global-img>``, ``<image>`` * seq and
``<fake_token_around_image>``; an image of one tile is just the global part without the leading
newline. The encoder's output rows replace the ``<image>`` tokens in order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

IMAGE_TOKEN = "<image>"
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TOKEN = "<global-img>"
MAX_IMAGE_SIDE = 4096  # transformers' absolute cap on the resized image (MAX_IMAGE_SIZE)
MAX_GRID = 6  # the checkpoints' tokenizers have <row_1_col_1> .. <row_6_col_6>


class ImageConfigError(ValueError):
    """A processor configuration inferd cannot follow; the message says what."""


@dataclass(frozen=True, slots=True)
class Idefics3ImageConfig:
    longest_edge: int  # size.longest_edge: the first resize's long side
    tile: int  # max_image_size.longest_edge: a tile's side (the encoder's image_size)
    image_seq_len: int  # <image> tokens per tile (patches per tile / scale_factor^2)
    splitting: bool = True
    do_resize: bool = True
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    resample: int = Image.Resampling.LANCZOS

    @classmethod
    def from_hf(cls, settings: Mapping[str, Any], image_seq_len: int) -> Idefics3ImageConfig:
        """From the image processor's settings (``preprocessor_config.json``, or the
        ``image_processor`` object of ``processor_config.json``)."""

        def edge(name: str, default: int) -> int:
            value = settings.get(name) or {}
            if not isinstance(value, Mapping):
                raise ImageConfigError(f"image processor {name} must be an object")
            return int(value.get("longest_edge", default))

        tile = edge("max_image_size", 364)
        mean = tuple(float(v) for v in settings.get("image_mean", (0.5, 0.5, 0.5)))
        std = tuple(float(v) for v in settings.get("image_std", (0.5, 0.5, 0.5)))
        if len(mean) != 3 or len(std) != 3:
            raise ImageConfigError("image_mean and image_std need three values (RGB)")
        return cls(
            longest_edge=edge("size", 4 * tile),
            tile=tile,
            image_seq_len=image_seq_len,
            splitting=bool(settings.get("do_image_splitting", True)),
            do_resize=bool(settings.get("do_resize", True)),
            rescale_factor=float(settings.get("rescale_factor", 1 / 255)),
            do_rescale=bool(settings.get("do_rescale", True)),
            do_normalize=bool(settings.get("do_normalize", True)),
            mean=(mean[0], mean[1], mean[2]),
            std=(std[0], std[1], std[2]),
            resample=int(settings.get("resample", Image.Resampling.LANCZOS)),
        )


@dataclass(frozen=True, slots=True)
class PixelNormalizer:
    """Tiles of bytes to the encoder's floats, in transformers' steps: the rescale in float64
    then float32, the normalization in float32 (so bit for bit the same values)."""

    rescale: float | None
    mean: tuple[float, float, float] | None
    std: tuple[float, float, float] | None

    def __call__(self, tiles: torch.Tensor) -> torch.Tensor:
        if self.rescale is not None:
            pixels = (tiles.double() * self.rescale).float()
        else:
            pixels = tiles.float()
        if self.mean is not None and self.std is not None:
            mean = torch.tensor(self.mean, dtype=torch.float32)[:, None, None]
            std = torch.tensor(self.std, dtype=torch.float32)[:, None, None]
            pixels = (pixels - mean) / std
        return pixels


@dataclass(frozen=True, slots=True)
class PreparedImage:
    """One image as the encoder takes it, and its place in the prompt. Its tiles stay bytes
    (a quarter of the floats' memory) until the encoder runs: ``pixel_values``."""

    tiles: torch.Tensor  # [tiles, 3, tile, tile] uint8; the global view last
    normalizer: PixelNormalizer
    rows: int  # 0 when the image is one tile (no split)
    cols: int
    image_seq_len: int

    @property
    def pixel_values(self) -> torch.Tensor:
        """[tiles, 3, tile, tile] float32, as transformers' processor gives them."""
        return self.normalizer(self.tiles)

    @property
    def num_tiles(self) -> int:
        return self.tiles.shape[0]

    @property
    def num_embeddings(self) -> int:
        """The <image> tokens it stands for: one encoder output row each."""
        return self.num_tiles * self.image_seq_len

    def prompt_text(self) -> str:
        return expansion(self.rows, self.cols, self.image_seq_len)


def expansion(rows: int, cols: int, image_seq_len: int) -> str:
    """The text that replaces one ``<image>`` in the prompt (transformers' layout exactly)."""
    tokens = IMAGE_TOKEN * image_seq_len
    global_view = f"{FAKE_TOKEN}{GLOBAL_TOKEN}{tokens}{FAKE_TOKEN}"
    if rows == 0 and cols == 0:
        return global_view
    text = ""
    for r in range(1, rows + 1):
        text += "".join(f"{FAKE_TOKEN}<row_{r}_col_{c}>{tokens}" for c in range(1, cols + 1))
        text += "\n"
    return text + "\n" + global_view


def _long_side_size(height: int, width: int, long_side: int) -> tuple[int, int]:
    """Long side to ``long_side`` (the short side truncated, then made even), then below the
    4096 cap; transformers' two size steps, in its integer arithmetic."""
    aspect = width / height
    if width >= height:
        width = long_side
        height = int(width / aspect)
        height += height % 2
    else:
        height = long_side
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIDE:
        width, height = MAX_IMAGE_SIDE, int(MAX_IMAGE_SIDE / aspect)
    elif height > width and height > MAX_IMAGE_SIDE:
        height, width = MAX_IMAGE_SIDE, int(MAX_IMAGE_SIDE * aspect)
    return max(height, 1), max(width, 1)


def _tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """Both sides up to whole tiles, the second derived from the first through the aspect
    ratio (as transformers' ``resize_for_vision_encoder`` does)."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def _resize(image: Image.Image, height: int, width: int, resample: int) -> Image.Image:
    return image.resize((width, height), resample=Image.Resampling(resample))


def normalizer(cfg: Idefics3ImageConfig) -> PixelNormalizer:
    return PixelNormalizer(
        cfg.rescale_factor if cfg.do_rescale else None,
        cfg.mean if cfg.do_normalize else None,
        cfg.std if cfg.do_normalize else None,
    )


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, any transparency composited over white (as transformers' processors do)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def tile_grid(width: int, height: int, cfg: Idefics3ImageConfig) -> tuple[int, int]:
    """(rows, cols) of the tiles an upright ``width`` x ``height`` image is split into, (0, 0)
    for one tile, from its size alone (the sizes ``prepare_image`` resizes to, without the
    pixels). ImageConfigError for a grid the tokenizer cannot mark, as ``prepare_image``
    raises."""
    if not cfg.splitting:
        return 0, 0
    if cfg.do_resize:
        height, width = _long_side_size(height, width, cfg.longest_edge)
    height, width = _tile_multiple_size(height, width, cfg.tile)
    if height <= cfg.tile and width <= cfg.tile:
        return 0, 0
    rows, cols = height // cfg.tile, width // cfg.tile
    if rows > MAX_GRID or cols > MAX_GRID:
        raise ImageConfigError(
            f"the image splits into {rows}x{cols} tiles; the tokenizer marks at most "
            f"{MAX_GRID}x{MAX_GRID}"
        )
    return rows, cols


def num_embeddings_for(width: int, height: int, cfg: Idefics3ImageConfig) -> int:
    """The <image> tokens an upright ``width`` x ``height`` image stands for (``tile_grid``)."""
    rows, cols = tile_grid(width, height, cfg)
    return (rows * cols + 1) * cfg.image_seq_len


def prepare_image(image: Image.Image, cfg: Idefics3ImageConfig) -> PreparedImage:
    """The encoder's tiles for one image (any mode: made RGB first, see ``to_rgb``)."""
    image = to_rgb(image)
    if cfg.do_resize:
        image = _resize(
            image, *_long_side_size(image.height, image.width, cfg.longest_edge), cfg.resample
        )
    rows = cols = 0
    if cfg.splitting:
        height, width = _tile_multiple_size(image.height, image.width, cfg.tile)
        image = _resize(image, height, width, cfg.resample)
        if height > cfg.tile or width > cfg.tile:
            rows, cols = height // cfg.tile, width // cfg.tile
            if rows > MAX_GRID or cols > MAX_GRID:
                raise ImageConfigError(
                    f"the image splits into {rows}x{cols} tiles; the tokenizer marks at most "
                    f"{MAX_GRID}x{MAX_GRID}"
                )
            t = cfg.tile
            tiles = [
                image.crop((c * t, r * t, (c + 1) * t, (r + 1) * t))
                for r in range(rows)
                for c in range(cols)
            ]
            tiles.append(_resize(image, t, t, cfg.resample))
        else:
            tiles = [image]
    else:
        tiles = [_resize(image, cfg.tile, cfg.tile, cfg.resample)]
    pixels = np.stack([np.asarray(t).transpose(2, 0, 1) for t in tiles])
    return PreparedImage(torch.from_numpy(pixels), normalizer(cfg), rows, cols, cfg.image_seq_len)
