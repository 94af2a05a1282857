"""Gemma 4 with images (models/gemma4_vision.py, models/gemma4_image.py) against transformers'
Gemma4ForConditionalGeneration and its processor, on the tiny random checkpoint of
tests/models/tiny_gemma4.py (clipped projections with finite bounds, standardized features,
an image's tokens attending both ways on the sliding layers).

The preprocessing is bit-equal to Gemma4ImageProcessorPil (patches, positions, soft-token
counts) for images of several shapes, the prompt's ids equal the processor's, and the float32
logits of a prompt holding two images equal transformers' (and so do the greedy tokens)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from inferd.loading.hf_model import load_safetensors_model
from inferd.loading.hf_processor import read_gemma4_image_config
from inferd.models.config import ModelConfigError
from inferd.models.gemma4_image import Gemma4ImageConfig, PreparedGemma4Image
from inferd.models.gemma4_multimodal import Gemma4MultimodalForCausalLM
from tests.models.paged import paged_logits
from tests.models.tiny_gemma4 import (
    BOI,
    EOI,
    IMAGE,
    MAX_SOFT_TOKENS,
    PATCH,
    POOLING,
    mm_token_id,
    save_tiny_gemma4,
)

LOGIT_TOLERANCE = 1e-3  # float32 on both sides over 160 tokens: only summation order differs
SHAPES = [(37, 50), (50, 37), (64, 64), (9, 200), (300, 12)]  # (height, width)
MESSAGES: list[dict[str, Any]] = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "Compare "},
            {"type": "image"},
            {"type": "text", "text": " with "},
            {"type": "image"},
            {"type": "text", "text": " please."},
        ],
    }
]


def _image(height: int, width: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


IMAGE_CONFIG = Gemma4ImageConfig(
    patch_size=PATCH,
    pooling=POOLING,
    max_soft_tokens=MAX_SOFT_TOKENS,
    image_token=IMAGE,
    boi_token=BOI,
    eoi_token=EOI,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    directory = tmp_path_factory.mktemp("gemma4_vision")
    model, processor = save_tiny_gemma4(directory)
    return directory, model, processor


@pytest.fixture(scope="module")
def ours(checkpoint: tuple[Path, Any, Any]) -> Gemma4MultimodalForCausalLM:
    model, _ = load_safetensors_model(checkpoint[0], torch.float32, progress=False)
    assert isinstance(model, Gemma4MultimodalForCausalLM)
    return model


@pytest.mark.parametrize("shape", SHAPES)
def test_preprocessing_is_bit_equal(checkpoint: tuple[Path, Any, Any], shape: tuple) -> None:
    processor = checkpoint[2]
    image = _image(*shape, seed=shape[0])
    expected = processor.image_processor(images=[image], return_tensors="pt")
    ours = IMAGE_CONFIG.prepare(image)
    n = ours.patches.shape[0]
    assert expected["num_soft_tokens_per_image"].tolist() == [ours.num_soft_tokens]
    assert ours.num_soft_tokens == IMAGE_CONFIG.num_soft_tokens(*shape)
    assert torch.equal(expected["pixel_values"][0, :n], ours.patches)
    assert torch.equal(expected["image_position_ids"][0, :n], ours.positions)
    assert (expected["image_position_ids"][0, n:] == -1).all()  # the rest is padding


def _prompt(processor: Any, images: list[PreparedGemma4Image]) -> tuple[list[int], Any]:
    """Our prompt ids (each image token expanded as we expand it) and the processor's output."""
    text = processor.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    parts = text.split(IMAGE)
    assert len(parts) == len(images) + 1
    ours = parts[0] + "".join(i.prompt_text() + p for i, p in zip(images, parts[1:], strict=True))
    ids = processor.tokenizer(ours, add_special_tokens=False)["input_ids"]
    return ids, text


def _spans(ids: list[int], token: int) -> tuple[tuple[int, int], ...]:
    """The [start, end) ranges of consecutive ``token``s (each image's soft tokens)."""
    spans, start = [], None
    for i, t in enumerate([*ids, -1]):
        if t == token and start is None:
            start = i
        elif t != token and start is not None:
            spans.append((start, i))
            start = None
    return tuple(spans)


def _forward(
    model: Gemma4MultimodalForCausalLM, ids: list[int], images: list[PreparedGemma4Image]
) -> torch.Tensor:
    """Logits of one prompt in one prefill, each image's rows over its tokens, which see each
    other both ways (the engine's ``bidirectional_spans``)."""
    token = mm_token_id(IMAGE)
    input_ids = torch.tensor(ids)
    with torch.inference_mode():
        embeds = model.embed(input_ids)
        rows = [model.encode_patches(i.patches, i.positions) for i in images]
        embeds[input_ids == token] = torch.cat(rows)
    return paged_logits(model, ids, embeds, spans=_spans(ids, token))


def test_image_prompt_logits_match_transformers(
    checkpoint: tuple[Path, Any, Any], ours: Gemma4MultimodalForCausalLM
) -> None:
    _, hf, processor = checkpoint
    pictures = [_image(37, 50, seed=1), _image(24, 24, seed=2)]
    prepared = [IMAGE_CONFIG.prepare(p) for p in pictures]
    ids, text = _prompt(processor, prepared)
    inputs = processor(text=[text], images=[pictures], return_tensors="pt")
    assert ids == inputs["input_ids"][0].tolist()
    assert len(ids) > 2 * 6  # past the sliding window
    with torch.no_grad():
        expected = hf(**inputs).logits[0]
    logits = _forward(ours, ids, prepared)
    assert (logits - expected).abs().max() < LOGIT_TOLERANCE
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_image_greedy_tokens_match_transformers(
    checkpoint: tuple[Path, Any, Any], ours: Gemma4MultimodalForCausalLM
) -> None:
    _, hf, processor = checkpoint
    pictures = [_image(30, 41, seed=3), _image(16, 40, seed=4)]
    prepared = [IMAGE_CONFIG.prepare(p) for p in pictures]
    ids, text = _prompt(processor, prepared)
    inputs = processor(text=[text], images=[pictures], return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=6, do_sample=False)
    expected = out[0, len(ids) :].tolist()
    for _ in range(6):
        ids = [*ids, int(_forward(ours, ids, prepared)[-1].argmax())]
    assert ids[-6:] == expected


def test_processor_settings_are_read(
    checkpoint: tuple[Path, Any, Any], ours: Gemma4MultimodalForCausalLM
) -> None:
    """The image settings and media tokens as the checkpoint saves them."""
    assert read_gemma4_image_config(checkpoint[0], ours.config) == IMAGE_CONFIG


def test_processor_settings_of_another_patch_size_are_refused(
    checkpoint: tuple[Path, Any, Any], ours: Gemma4MultimodalForCausalLM, tmp_path: Path
) -> None:
    for name in ("tokenizer_config.json", "processor_config.json"):
        (tmp_path / name).write_text((checkpoint[0] / name).read_text())
    settings = json.loads((tmp_path / "processor_config.json").read_text())
    settings["image_processor"]["patch_size"] = 2 * PATCH
    (tmp_path / "processor_config.json").write_text(json.dumps(settings))
    with pytest.raises(ModelConfigError, match="not the encoder's"):
        read_gemma4_image_config(tmp_path, ours.config)
