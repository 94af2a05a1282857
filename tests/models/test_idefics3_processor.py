"""Our Idefics3 image preprocessing against transformers' processor on generated images:
the same tiles, bit for bit, and the same prompt tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from inferd.models.idefics3_image import Idefics3ImageConfig, prepare_image
from tests.models.tiny_vlm import IMAGE_SEQ_LEN, LONGEST, TILE


def generated(height: int, width: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Smooth gradients plus noise: resampling filters see edges and flat parts alike. RGBA
    gets a varying alpha; P a palette with one transparent entry."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width, 1), y * 255 // max(height, 1), (x + y) % 256], -1)
    noisy = np.clip(base + rng.integers(-40, 40, base.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(noisy, "RGB")
    if mode == "RGBA":
        alpha = Image.fromarray(((x * 7 + y * 3) % 256).astype(np.uint8), "L")
        image.putalpha(alpha)
        return image
    if mode == "P":
        image = image.quantize(16)
        image.info["transparency"] = 3
        return image
    return image.convert(mode) if mode != "RGB" else image


SIZES = [
    (5, 7),  # tiny: upsampled to the long side, one tile... or more
    (20, 20),
    (32, 32),
    (70, 50),
    (50, 70),
    (300, 200),
    (31, 400),  # a wide strip
    (900, 12),  # a tall sliver
    (1, 1),
]


@pytest.fixture(scope="module")
def config(tiny_idefics3: tuple[Path, Any, Any]) -> Idefics3ImageConfig:
    settings = tiny_idefics3[2].image_processor.to_dict()
    return Idefics3ImageConfig.from_hf(settings, IMAGE_SEQ_LEN)


def test_config_reads_the_checkpoint(config: Idefics3ImageConfig) -> None:
    assert (config.longest_edge, config.tile, config.splitting) == (LONGEST, TILE, True)


@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA", "P", "LA"])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_tiles_match_transformers_bit_for_bit(
    size: tuple[int, int], mode: str, config: Idefics3ImageConfig, tiny_idefics3: Any
) -> None:
    processor = tiny_idefics3[2]
    image = generated(*size, mode=mode, seed=size[0] * 1000 + size[1])
    ref = processor.image_processor([[image]], return_tensors="pt", return_row_col_info=True)
    ours = prepare_image(image, config)
    expected = ref["pixel_values"][0]
    assert ours.pixel_values.dtype == torch.float32
    assert ours.pixel_values.shape == expected.shape
    assert torch.equal(ours.pixel_values, expected)  # exact: same filter, same float steps
    assert (ours.rows, ours.cols) == (ref["rows"][0][0], ref["cols"][0][0])


def test_big_images_split_into_tiles(config: Idefics3ImageConfig) -> None:
    wide = prepare_image(generated(300, 200), config)
    assert (wide.rows, wide.cols, wide.num_tiles) == (3, 2, 7)
    assert prepare_image(generated(20, 20), config).num_tiles == 1 + 9  # upsampled to 96


def test_prompt_expansion_matches_transformers(
    config: Idefics3ImageConfig, tiny_idefics3: Any
) -> None:
    processor = tiny_idefics3[2]
    images = [generated(300, 200), generated(16, 40, seed=3)]
    text = f"Look: {processor.image_token} and{processor.image_token} done"
    ref = processor(text=[text], images=[images])
    pieces = text.split(processor.image_token)
    ours = pieces[0] + "".join(
        prepare_image(image, config).prompt_text() + rest
        for image, rest in zip(images, pieces[1:], strict=True)
    )
    ours_ids = processor.tokenizer(ours)["input_ids"]
    assert ours_ids == ref["input_ids"][0]
    placeholders = sum(prepare_image(i, config).num_embeddings for i in images)
    assert ours_ids.count(processor.image_token_id) == placeholders


def test_without_splitting_one_tile(config: Idefics3ImageConfig, tiny_idefics3: Any) -> None:
    from dataclasses import replace

    processor = tiny_idefics3[2]
    image = generated(300, 200)
    ref = processor.image_processor([[image]], return_tensors="pt", do_image_splitting=False)
    ours = prepare_image(image, replace(config, splitting=False))
    assert torch.equal(ours.pixel_values, ref["pixel_values"][0])
    assert ours.prompt_text().count("<image>") == IMAGE_SEQ_LEN
