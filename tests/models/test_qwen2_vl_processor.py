"""Our Qwen2-VL image and video preprocessing against transformers' on generated inputs: the
image processor's patches bit for bit and its grids (sizes that round up, down, past the pixel
bounds, extreme aspects, every mode), ``smart_resize`` over a sweep of sizes, the prompt's
placeholder count, and a video's patches laid out as the video processor lays them.

transformers' video processor needs torchvision (not installed here): a video of still frames
at an aligned size (no resize) must give the image processor's patches of that frame (the
video processor normalizes in one fused float32 step, so within float32 rounding), and pairs of
different frames must land in the temporal slots of each patch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from inferd.loading.hf_processor import read_visual_configs
from inferd.models.config import config_from_hf
from inferd.models.idefics3_image import ImageConfigError
from inferd.models.qwen2_vl_image import (
    IMAGE_PAD,
    QwenVisualConfig,
    prepare_image,
    prepare_video,
    smart_resize,
)
from tests.models.test_idefics3_processor import generated
from tests.models.tiny_qwen_vl import MAX_PIXELS, MIN_PIXELS, VIDEO_MAX_PIXELS


@pytest.fixture(scope="module")
def configs(tiny_qwen2_5_vl: tuple[Path, Any, Any]) -> tuple[QwenVisualConfig, QwenVisualConfig]:
    import json

    directory = tiny_qwen2_5_vl[0]
    cfg = config_from_hf(json.loads((directory / "config.json").read_text()))
    found = read_visual_configs(directory, cfg)
    assert found is not None
    return found


def test_configs_read_the_checkpoint(configs: tuple[QwenVisualConfig, QwenVisualConfig]) -> None:
    image, video = configs
    assert (image.min_pixels, image.max_pixels) == (MIN_PIXELS, MAX_PIXELS)
    assert video.max_pixels == VIDEO_MAX_PIXELS and image.factor == video.factor == 28


SIZES = [
    (56, 56),  # exactly aligned
    (100, 150),
    (150, 100),
    (20, 20),  # below min_pixels: scaled up
    (500, 400),  # past max_pixels: scaled down
    (29, 700),  # a wide strip
    (900, 15),  # a tall sliver
    (1, 1),
]


@pytest.mark.parametrize(("height", "width"), SIZES)
def test_image_patches_equal_transformers(
    height: int,
    width: int,
    configs: tuple[QwenVisualConfig, QwenVisualConfig],
    tiny_qwen2_5_vl: tuple[Path, Any, Any],
) -> None:
    processor = tiny_qwen2_5_vl[2]
    image = generated(height, width, seed=height * 7 + width)
    ref = processor.image_processor(images=[image], return_tensors="pt")
    ours = prepare_image(image, configs[0])
    assert [list(ours.grid)] == ref["image_grid_thw"].tolist()
    assert torch.equal(ours.patches, ref["pixel_values"])
    text = processor.tokenizer(ours.prompt_text())["input_ids"]
    merge = processor.image_processor.merge_size
    assert len(text) == ref["image_grid_thw"].prod().item() // merge**2
    assert set(text) == {processor.tokenizer.convert_tokens_to_ids(IMAGE_PAD)}


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "LA", "CMYK"])
def test_image_modes_equal_transformers(
    mode: str,
    configs: tuple[QwenVisualConfig, QwenVisualConfig],
    tiny_qwen2_5_vl: tuple[Path, Any, Any],
) -> None:
    processor = tiny_qwen2_5_vl[2]
    image = generated(70, 90, mode=mode, seed=3)
    ref = processor.image_processor(images=[image], return_tensors="pt")
    assert torch.equal(prepare_image(image, configs[0]).patches, ref["pixel_values"])


def test_smart_resize_equals_transformers(
    configs: tuple[QwenVisualConfig, QwenVisualConfig],
) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        smart_resize as reference,
    )

    for cfg in configs:
        for h in [*range(1, 120, 7), 333, 1000, 4000]:
            for w in [1, 13, 28, 57, 200, 999]:
                if max(h, w) / min(h, w) > 200:
                    with pytest.raises(ImageConfigError):
                        smart_resize(h, w, cfg)
                    continue
                expected = reference(h, w, cfg.factor, cfg.min_pixels, cfg.max_pixels)
                assert smart_resize(h, w, cfg) == expected


def test_still_video_equals_the_image_processor(
    configs: tuple[QwenVisualConfig, QwenVisualConfig],
    tiny_qwen2_5_vl: tuple[Path, Any, Any],
) -> None:
    processor = tiny_qwen2_5_vl[2]
    frame = np.asarray(generated(56, 84, seed=11))  # aligned and within bounds: no resize
    video = prepare_video(np.stack([frame, frame]), 2.0, configs[1])
    ref = processor.image_processor(images=[frame], return_tensors="pt")
    assert [list(video.grid)] == ref["image_grid_thw"].tolist()
    torch.testing.assert_close(video.patches, ref["pixel_values"], atol=2e-6, rtol=0)
    assert video.seconds_per_grid == 1.0


def test_video_frames_fill_temporal_slots_in_order(
    configs: tuple[QwenVisualConfig, QwenVisualConfig],
) -> None:
    """Five frames: three temporal patches (the last frame repeated); within each patch's
    values (channel, time, row, col) time slot k holds frame 2t + k."""
    cfg = configs[1]
    levels = [10, 60, 110, 160, 210]
    clip = np.stack([np.full((56, 56, 3), v, np.uint8) for v in levels])
    video = prepare_video(clip, 4.0, cfg)
    assert video.grid == (3, 4, 4) and video.seconds_per_grid == 0.5
    p = cfg.patch_size
    patches = video.patches.view(3, 16, 3, 2, p, p)
    mean, std = torch.tensor(cfg.mean) * 255, torch.tensor(cfg.std) * 255
    for t in range(3):
        for k in range(2):
            level = levels[min(2 * t + k, 4)]
            expected = (level - mean) / std
            got = patches[t, :, :, k].mean(dim=(0, 2, 3))
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_video_resize_keeps_bounds_and_content(
    configs: tuple[QwenVisualConfig, QwenVisualConfig],
) -> None:
    """A large clip shrinks to smart_resize's size within the video bounds, and a smooth
    gradient stays a gradient (antialiased bicubic on the bytes, as torchvision on the CPU)."""
    cfg = configs[1]
    y, x = np.mgrid[0:240, 0:320]
    frame = np.stack([x * 255 // 319, y * 255 // 239, np.full_like(x, 128)], -1).astype(np.uint8)
    video = prepare_video(np.stack([frame] * 2), 2.0, cfg)
    height, width = video.pixels.shape[-2:]
    assert (height, width) == smart_resize(240, 320, cfg)
    assert height * width <= cfg.max_pixels
    row = video.pixels[0, 0, 0].int()
    assert bool((row[1:] >= row[:-1]).all()) and int(row[-1] - row[0]) > 200
