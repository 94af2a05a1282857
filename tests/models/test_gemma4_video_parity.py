"""Gemma 4 with video on the tiny random checkpoint of tests/models/tiny_gemma4.py: the prompt
text of a video equals what transformers' Gemma4Processor writes for it (``mm:ss`` times and
each frame's tokens), and the float32 logits and greedy tokens of a prompt holding a three-frame
video equal Gemma4ForConditionalGeneration's given the same frame patches.

transformers' video processor needs torchvision, which is not installed here, so frames are
prepared by our image path at the video budget and handed to both models as patches; its
resize (torchvision's antialiased bicubic) is not compared."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from inferd.loading.hf_model import load_safetensors_model
from inferd.models.gemma4_image import PreparedGemma4Image, video_prompt_text
from inferd.models.gemma4_multimodal import Gemma4MultimodalForCausalLM
from tests.models.paged import paged_logits
from tests.models.test_gemma4_vision_parity import IMAGE_CONFIG, _image, _spans
from tests.models.tiny_gemma4 import MAX_SOFT_TOKENS, VIDEO, mm_token_id, save_tiny_gemma4

LOGIT_TOLERANCE = 1e-3  # float32 on both sides over 100+ tokens: only summation order differs
TIMESTAMPS = [0.0, 1.5, 61.25]  # seconds of the kept frames


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Any]:
    directory: Path = tmp_path_factory.mktemp("gemma4_video")
    hf, processor = save_tiny_gemma4(directory)
    ours, _ = load_safetensors_model(directory, torch.float32, progress=False)
    assert isinstance(ours, Gemma4MultimodalForCausalLM)
    return hf, processor, ours


def test_video_prompt_text_is_the_processors(checkpoint: tuple[Any, Any, Any]) -> None:
    from transformers.video_utils import VideoMetadata

    processor = checkpoint[1]
    fps = 4.0
    metadata = VideoMetadata(
        total_num_frames=300, fps=fps, frames_indices=[round(t * fps) for t in TIMESTAMPS]
    )
    expected = processor.replace_video_token(
        {"num_soft_tokens_per_video": [12], "video_metadata": [metadata]}, 0
    )
    assert video_prompt_text(IMAGE_CONFIG, VIDEO, TIMESTAMPS, 12) == expected
    assert expected.startswith("00:00 ") and " 01:01 " in expected


def _frames() -> list[PreparedGemma4Image]:
    return [IMAGE_CONFIG.prepare(_image(21, 30, seed=10 + i)) for i in range(len(TIMESTAMPS))]


def _ids(processor: Any, frames: list[PreparedGemma4Image]) -> list[int]:
    video = video_prompt_text(IMAGE_CONFIG, VIDEO, TIMESTAMPS, frames[0].num_soft_tokens)
    text = f"<start_of_turn>user\nWatch {video} and tell.<end_of_turn>\n<start_of_turn>model\n"
    return processor.tokenizer(text, add_special_tokens=False)["input_ids"]


def _hf_inputs(ids: list[int], frames: list[PreparedGemma4Image]) -> dict[str, Any]:
    """transformers' video inputs for these frames: patches padded to the budget, (-1, -1)
    places for the padding, as its video processor lays them out."""
    budget = MAX_SOFT_TOKENS * IMAGE_CONFIG.pooling**2
    pixels = torch.zeros(len(frames), budget, frames[0].patches.shape[1])
    places = torch.full((len(frames), budget, 2), -1, dtype=torch.long)
    for i, frame in enumerate(frames):
        pixels[i, : frame.patches.shape[0]] = frame.patches
        places[i, : frame.positions.shape[0]] = frame.positions
    input_ids = torch.tensor([ids])
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "mm_token_type_ids": (input_ids == mm_token_id(VIDEO)).long() * 2,
        "pixel_values_videos": pixels,
        "video_position_ids": places,
        "num_frames_per_video": torch.tensor([len(frames)]),
    }


def _forward(
    model: Gemma4MultimodalForCausalLM, ids: list[int], frames: list[PreparedGemma4Image]
) -> torch.Tensor:
    """Logits of one prompt in one prefill: each frame's rows over its video tokens, which see
    each other both ways."""
    token = mm_token_id(VIDEO)
    spans = _spans(ids, token)
    assert len(spans) == len(frames)  # a frame's tokens are one span, apart from the next's
    input_ids = torch.tensor(ids)
    with torch.inference_mode():
        embeds = model.embed(input_ids)
        rows = [model.encode_patches(f.patches, f.positions) for f in frames]
        embeds[input_ids == token] = torch.cat(rows)
    return paged_logits(model, ids, embeds, spans=spans)


def test_video_prompt_logits_match_transformers(checkpoint: tuple[Any, Any, Any]) -> None:
    hf, processor, ours = checkpoint
    frames = _frames()
    ids = _ids(processor, frames)
    with torch.no_grad():
        expected = hf(**_hf_inputs(ids, frames)).logits[0]
    logits = _forward(ours, ids, frames)
    assert (logits - expected).abs().max() < LOGIT_TOLERANCE
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_video_greedy_tokens_match_transformers(checkpoint: tuple[Any, Any, Any]) -> None:
    hf, processor, ours = checkpoint
    frames = _frames()
    ids = _ids(processor, frames)
    with torch.no_grad():
        out = hf.generate(**_hf_inputs(ids, frames), max_new_tokens=5, do_sample=False)
    expected = out[0, len(ids) :].tolist()
    for _ in range(5):
        ids = [*ids, int(_forward(ours, ids, frames)[-1].argmax())]
    assert ids[-5:] == expected
