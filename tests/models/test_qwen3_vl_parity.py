"""Our Qwen3-VL against transformers on the tiny random checkpoint (f32): the config read from
it, the logits of every position for text alone, one image and two images (deep-stack rows
added in the first decoder layers, interleaved M-RoPE positions equal to transformers'
``get_rope_index``), greedy tokens, the encoder's main and deep-stack rows for grids that
resample the learned position grid up and down, a prefill cut into chunks through an image,
and the image processor's patches, grids and token counts bit-equal to transformers'."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from inferd.loading.hf_model import load_safetensors_model
from inferd.loading.hf_processor import read_visual_configs
from inferd.models.config import config_from_hf
from inferd.models.qwen2_vl_image import (
    IMAGE_PAD,
    PreparedVisual,
    QwenVisualConfig,
    image_tokens,
    prepare_image,
)
from inferd.models.qwen3_vl import Qwen3VLForCausalLM
from tests.models.paged import paged_logits
from tests.models.test_idefics3_processor import generated
from tests.models.test_qwen2_5_vl_parity import IMAGE, expand
from tests.models.tiny_qwen3_vl import DEEPSTACK, SECTIONS, save_tiny_qwen3_vl

Setup = tuple[Qwen3VLForCausalLM, QwenVisualConfig, QwenVisualConfig]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    directory = tmp_path_factory.mktemp("qwen3_vl")
    model, processor = save_tiny_qwen3_vl(directory)
    return directory, model, processor


@pytest.fixture(scope="module")
def ours(tiny: tuple[Path, Any, Any]) -> Setup:
    model, cfg = load_safetensors_model(tiny[0], torch.float32, progress=False)
    assert isinstance(model, Qwen3VLForCausalLM)
    configs = read_visual_configs(tiny[0], cfg)
    assert configs is not None
    return model, configs[0], configs[1]


def test_config_reads_the_checkpoint(tiny: tuple[Path, Any, Any]) -> None:
    cfg = config_from_hf(json.loads((tiny[0] / "config.json").read_text()))
    ref = tiny[1].config
    assert cfg.architecture == "qwen3_vl" and cfg.qk_norm and not cfg.attention_bias
    assert cfg.mrope_section == tuple(SECTIONS) and cfg.mrope_interleaved
    assert (cfg.head_dim, cfg.num_layers, cfg.tie_word_embeddings) == (32, 3, False)
    q = cfg.qwen_vision
    assert q is not None and q.deepstack_indexes == tuple(DEEPSTACK)
    assert (q.patch_size, q.num_position_embeddings, q.hidden_act) == (16, 16, "gelu_tanh")
    assert (q.image_token_id, q.video_token_id) == (ref.image_token_id, ref.video_token_id)
    assert cfg.input_modalities == ("text", "image", "video")


def our_inputs(
    model: Qwen3VLForCausalLM, ids: list[int], prepared: list[PreparedVisual]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (wide) embeddings with the encoder's rows over the placeholders, and the M-RoPE
    positions."""
    x = model.embed(torch.tensor(ids)).clone()
    spans, at = [], 0
    token = model.vision_config.image_token_id
    with torch.inference_mode():
        for p in prepared:
            first = ids.index(token, at)
            at = first + p.num_embeddings
            assert ids[first:at] == [token] * p.num_embeddings
            x[first:at] = model.encode_grids(p.patches, [p.grid])[0]
            spans.append((first, p.grid, 0.0))
    return x, model.rope_index(len(ids), spans)


def reference(hf: Any, ids: list[int], prepared: list[PreparedVisual]) -> dict[str, Any]:
    q = hf.config
    mm = [1 if i == q.image_token_id else 0 for i in ids]
    inputs: dict[str, Any] = {
        "input_ids": torch.tensor([ids]),
        "mm_token_type_ids": torch.tensor([mm]),
    }
    if prepared:
        inputs["pixel_values"] = torch.cat([p.patches for p in prepared])
        inputs["image_grid_thw"] = torch.tensor([p.grid for p in prepared])
    return inputs


CASES: dict[str, tuple[str, list[tuple[int, int, int]]]] = {
    "text only": ("<|im_start|>user\nThe quick brown fox jumps over the lazy dog.", []),
    "one image": (f"<|im_start|>user\n{IMAGE}What is in the picture?<|im_end|>\n", [(150, 100, 1)]),
    "two images": (
        f"<|im_start|>user\nFirst {IMAGE} and second {IMAGE}: which is wider?",
        [(60, 200, 2), (90, 70, 3)],
    ),
}


def case_inputs(case: str, ours: Setup, processor: Any) -> tuple[list[int], list[PreparedVisual]]:
    text, specs = CASES[case]
    prepared = [prepare_image(generated(h, w, seed=s), ours[1]) for h, w, s in specs]
    return processor.tokenizer(expand(text, prepared))["input_ids"], prepared


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case: str, ours: Setup, tiny: tuple[Path, Any, Any]) -> None:
    model = ours[0]
    _, hf, processor = tiny
    ids, prepared = case_inputs(case, ours, processor)
    inputs = reference(hf, ids, prepared)
    with torch.inference_mode():
        ref = hf(**inputs).logits[0]
    embeds, positions = our_inputs(model, ids, prepared)
    if prepared:
        ref_positions, delta = hf.model.get_rope_index(**inputs)
        assert torch.equal(positions, ref_positions[:, 0])
        assert int(positions.max()) + 1 - len(ids) == int(delta) < 0
    logits = paged_logits(model, ids, embeds, positions=positions)
    assert (logits - ref).abs().max() <= 1e-4
    if prepared:  # the deep stack matters: without its rows the logits move
        hidden = model.config.hidden_size
        shallow = embeds.clone()
        shallow[:, hidden:] = 0
        moved = paged_logits(model, ids, shallow, positions=positions)
        assert (moved - logits).abs().max() > 1e-2


@pytest.mark.parametrize("case", ["text only", "two images"])
def test_greedy_tokens_match_transformers(
    case: str, ours: Setup, tiny: tuple[Path, Any, Any]
) -> None:
    """Six greedy tokens; ours re-run whole each step, the tokens after the prompt at
    ``p + delta`` on all three axes (what the runner gives them)."""
    model = ours[0]
    _, hf, processor = tiny
    ids, prepared = case_inputs(case, ours, processor)
    inputs = reference(hf, ids, prepared)
    with torch.inference_mode():
        out = hf.generate(
            **inputs,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=6,
            do_sample=False,
        )
    expected = out[0, len(ids) :].tolist()
    embeds, positions = our_inputs(model, ids, prepared)
    delta = int(positions.max()) + 1 - len(ids)
    tokens: list[int] = []
    for _ in range(6):
        n = len(ids) + len(tokens)
        later = torch.arange(len(ids), n).expand(3, -1) + delta
        rows = torch.cat((embeds, model.embed(torch.tensor(tokens, dtype=torch.long))))
        logits = paged_logits(model, ids + tokens, rows, positions=torch.cat((positions, later), 1))
        tokens.append(int(logits[-1].argmax()))
    assert tokens == expected


@pytest.mark.parametrize(("height", "width"), [(64, 64), (150, 260), (300, 120)])
def test_encoder_matches_transformers(
    height: int, width: int, ours: Setup, tiny: tuple[Path, Any, Any]
) -> None:
    """Main and deep-stack rows of two images in one call: grids smaller and larger than the
    4x4 position grid, not square."""
    model, image_cfg, _ = ours
    hf = tiny[1]
    images = [
        prepare_image(generated(height, width, seed=9), image_cfg),
        prepare_image(generated(width, height, seed=10), image_cfg),
    ]
    patches = torch.cat([p.patches for p in images])
    grids = [p.grid for p in images]
    with torch.inference_mode():
        ref = hf.model.get_image_features(patches, torch.tensor(grids))
        mine = model.encode_grids(patches, grids)
    for i, rows in enumerate(mine):
        levels = [ref.pooler_output[i], *(d[i] for d in ref.deepstack_features)]
        expected = torch.cat(levels, -1)
        assert rows.shape == expected.shape
        torch.testing.assert_close(rows, expected, atol=2e-5, rtol=1e-5)


def test_chunked_prefill_through_an_image_equals_whole(ours: Setup) -> None:
    from tests.models.tiny_qwen_vl import vl_tokenizer

    model, image_cfg, _ = ours
    prepared = [prepare_image(generated(120, 90, seed=4), image_cfg)]
    ids = vl_tokenizer().encode(expand(f"Look {IMAGE} and say.", prepared)).ids
    embeds, positions = our_inputs(model, ids, prepared)
    whole = paged_logits(model, ids, embeds, positions=positions)
    chunked = paged_logits(model, ids, embeds, positions=positions, cuts=range(5, len(ids), 5))
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=1e-4)


SIZES = [(64, 64), (100, 150), (150, 100), (20, 20), (500, 400), (33, 700), (900, 17)]


@pytest.mark.parametrize(("height", "width"), SIZES)
def test_image_processor_bit_equal(
    height: int, width: int, ours: Setup, tiny: tuple[Path, Any, Any]
) -> None:
    """Qwen3-VL's image settings (16 px patches, mean and std 0.5): patches bit for bit, the
    grid, and the placeholder count from the size alone and in the processor's prompt."""
    image_cfg = ours[1]
    processor = tiny[2]
    image = generated(height, width, seed=height + width)
    ref = processor.image_processor(images=[image], return_tensors="pt")
    mine = prepare_image(image, image_cfg)
    assert mine.grid == tuple(ref["image_grid_thw"][0].tolist())
    assert torch.equal(mine.patches, ref["pixel_values"])
    count = int(ref["image_grid_thw"][0].prod()) // 4
    assert mine.num_embeddings == image_tokens(width, height, image_cfg) == count
    assert mine.prompt_text() == IMAGE_PAD * count
    assert np.asarray(image).shape == (height, width, 3)
