"""Our Qwen2.5-VL against transformers on the tiny random checkpoint (f32): the logits of every
position for text alone, one image, two images and one video, the M-RoPE positions equal to
transformers' ``get_rope_index``, the encoder's rows for images of several window layouts, and
a prefill cut into chunks through an image giving the logits of the whole."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from inferd.loading.hf_model import load_safetensors_model
from inferd.loading.hf_processor import read_visual_configs
from inferd.models.qwen2_5_vl import Qwen2_5_VLForCausalLM
from inferd.models.qwen2_vl_image import (
    IMAGE_PAD,
    VIDEO_PAD,
    PreparedVisual,
    QwenVisualConfig,
    prepare_image,
    prepare_video,
)
from tests.models.paged import paged_logits
from tests.models.test_idefics3_processor import generated
from tests.models.tiny_qwen_vl import TOKENS_PER_SECOND

Setup = tuple[Qwen2_5_VLForCausalLM, QwenVisualConfig, QwenVisualConfig]


@pytest.fixture(scope="module")
def ours(tiny_qwen2_5_vl: tuple[Path, Any, Any]) -> Setup:
    model, cfg = load_safetensors_model(tiny_qwen2_5_vl[0], torch.float32, progress=False)
    assert isinstance(model, Qwen2_5_VLForCausalLM)
    assert cfg.architecture == "qwen2_5_vl" and cfg.mrope_section == (2, 3, 3)
    configs = read_visual_configs(tiny_qwen2_5_vl[0], cfg)
    assert configs is not None
    return model, configs[0], configs[1]


def frames(n: int, height: int, width: int, seed: int) -> np.ndarray:
    """Moving gradients with noise: each frame differs from the last."""
    return np.stack(
        [np.asarray(generated(height, width, seed=seed + i).rotate(7 * i)) for i in range(n)]
    )


def token_of(model: Qwen2_5_VLForCausalLM, p: PreparedVisual) -> int:
    q = model.vision_config
    return q.image_token_id if p.modality == "image" else q.video_token_id


def our_inputs(
    model: Qwen2_5_VLForCausalLM, ids: list[int], prepared: list[PreparedVisual]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The embeddings (media rows written over their placeholders) and M-RoPE positions."""
    x = model.embed(torch.tensor(ids)).clone()
    spans, at = [], 0
    with torch.inference_mode():
        for p in prepared:
            token = token_of(model, p)
            first = ids.index(token, at)
            at = first + p.num_embeddings
            assert ids[first:at] == [token] * p.num_embeddings
            x[first:at] = model.encode_grids(p.patches, [p.grid])[0]
            spans.append((first, p.grid, p.seconds_per_grid * TOKENS_PER_SECOND))
    return x, model.rope_index(len(ids), spans)


def expand(text: str, prepared: list[PreparedVisual]) -> str:
    """The processor's expansion: each pad marker repeated once per encoder row."""
    out, rest = "", text
    for p in prepared:
        marker = IMAGE_PAD if p.modality == "image" else VIDEO_PAD
        head, _, rest = rest.partition(marker)
        out += head + p.prompt_text()
    return out + rest


def reference(hf: Any, ids: list[int], prepared: list[PreparedVisual]) -> dict[str, Any]:
    """transformers' inputs for the same patches (its image processor's are checked equal to
    ours in test_qwen2_vl_processor.py)."""
    q = hf.config
    mm = [1 if i == q.image_token_id else 2 if i == q.video_token_id else 0 for i in ids]
    inputs: dict[str, Any] = {
        "input_ids": torch.tensor([ids]),
        "mm_token_type_ids": torch.tensor([mm]),
    }
    images = [p for p in prepared if p.modality == "image"]
    videos = [p for p in prepared if p.modality == "video"]
    if images:
        inputs["pixel_values"] = torch.cat([p.patches for p in images])
        inputs["image_grid_thw"] = torch.tensor([p.grid for p in images])
    if videos:
        inputs["pixel_values_videos"] = torch.cat([p.patches for p in videos])
        inputs["video_grid_thw"] = torch.tensor([p.grid for p in videos])
        inputs["second_per_grid_ts"] = torch.tensor([p.seconds_per_grid for p in videos])
    return inputs


VS = "<|vision_start|>"
VE = "<|vision_end|>"
IMAGE = f"{VS}{IMAGE_PAD}{VE}"
VIDEO = f"{VS}{VIDEO_PAD}{VE}"
CASES: dict[str, tuple[str, list[Any]]] = {
    "text only": ("<|im_start|>user\nThe quick brown fox jumps over the lazy dog.", []),
    "one image": (
        f"<|im_start|>user\n{IMAGE}What is in the picture?<|im_end|>\n",
        [("image", 150, 100, 1)],
    ),
    "two images": (
        f"<|im_start|>user\nFirst {IMAGE} and second {IMAGE}: which is wider?",
        [("image", 60, 200, 2), ("image", 90, 70, 3)],
    ),
    # 4 frames at 2 fps: two temporal patches of 1 s, temporal positions 0 and 2.
    "one video": (
        f"<|im_start|>user\n{VIDEO}What happens in the clip?<|im_end|>\n",
        [("video", 60, 90, 4)],
    ),
}


def prepare(
    spec: tuple[str, int, int, int], image: QwenVisualConfig, video: QwenVisualConfig
) -> PreparedVisual:
    kind, height, width, seed = spec
    if kind == "image":
        return prepare_image(generated(height, width, seed=seed), image)
    return prepare_video(frames(4, height, width, seed), 2.0, video)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(
    case: str, ours: Setup, tiny_qwen2_5_vl: tuple[Path, Any, Any]
) -> None:
    model, image_cfg, video_cfg = ours
    _, hf, processor = tiny_qwen2_5_vl
    text, specs = CASES[case]
    prepared = [prepare(s, image_cfg, video_cfg) for s in specs]
    ids = processor.tokenizer(expand(text, prepared))["input_ids"]
    inputs = reference(hf, ids, prepared)
    with torch.inference_mode():
        ref = hf(**inputs).logits[0]
    embeds, positions = our_inputs(model, ids, prepared)
    if prepared:
        ref_positions, delta = hf.model.get_rope_index(**inputs)
        assert torch.equal(positions, ref_positions[:, 0])
        assert int(positions.max()) + 1 - len(ids) == int(delta)
        assert int(delta) < 0  # media positions are packed: later text sits closer
    logits = paged_logits(model, ids, embeds, positions=positions)
    assert (logits - ref).abs().max() <= 1e-4
    if prepared:  # the media really reach the logits: other pixels change them
        flipped = [
            PreparedVisual(p.pixels.flip(-1), p.cfg, p.modality, p.seconds_per_grid)
            for p in prepared
        ]
        moved = paged_logits(model, ids, our_inputs(model, ids, flipped)[0], positions=positions)
        assert (moved - logits).abs().max() > 1e-2


@pytest.mark.parametrize(("height", "width"), [(56, 56), (140, 250), (300, 120)])
def test_encoder_matches_transformers(
    height: int, width: int, ours: Setup, tiny_qwen2_5_vl: tuple[Path, Any, Any]
) -> None:
    """The encoder's rows for grids of one window and of several, partial windows at the
    edges (56 px windows are 2x2 merge groups), two images in one call."""
    model, image_cfg, _ = ours
    hf = tiny_qwen2_5_vl[1]
    images = [
        prepare_image(generated(height, width, seed=9), image_cfg),
        prepare_image(generated(width, height, seed=10), image_cfg),
    ]
    patches = torch.cat([p.patches for p in images])
    grids = [p.grid for p in images]
    with torch.inference_mode():
        ref = hf.model.get_image_features(patches, torch.tensor(grids)).pooler_output
        mine = model.encode_grids(patches, grids)
    for a, b in zip(mine, ref, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


def test_chunked_prefill_through_media_equals_whole(ours: Setup) -> None:
    model, image_cfg, video_cfg = ours
    prepared = [
        prepare_image(generated(120, 90, seed=4), image_cfg),
        prepare_video(frames(3, 50, 70, 5), 2.0, video_cfg),  # odd frames: the last repeated
    ]
    from tests.models.tiny_qwen_vl import vl_tokenizer

    tok = vl_tokenizer()
    text = expand(f"Look {IMAGE} then {VIDEO} and say.", prepared)
    ids = tok.encode(text).ids
    embeds, positions = our_inputs(model, ids, prepared)
    whole = paged_logits(model, ids, embeds, positions=positions)
    cuts = range(7, len(ids), 7)  # chunks end mid-media
    chunked = paged_logits(model, ids, embeds, positions=positions, cuts=cuts)
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=1e-4)


def test_text_after_a_long_video_continues_past_its_largest_position(ours: Setup) -> None:
    """A video whose temporal positions outrun its height and width: the text after it starts
    one past the largest (the original model's rule, and what decode's delta assumes)."""
    model = ours[0]
    grid = (6, 4, 4)  # 6 temporal patches, 2x2 merged rows and columns
    positions = model.rope_index(30, [(2, grid, 2.0)])
    media = positions[:, 2:26]
    assert int(media[0].max()) == 2 + 5 * 2
    assert positions[:, 26].tolist() == [int(media.max()) + 1] * 3
    assert positions[:, :2].tolist() == [[0, 1]] * 3


# Qwen/Qwen2.5-VL-3B-Instruct's config.json: flat, the text keys at the top level.
PUBLISHED_CONFIG = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_attention_heads": 16,
    "num_hidden_layers": 36,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 128000,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "sliding_window": 32768,
    "vocab_size": 151936,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {
        "depth": 32,
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_chans": 3,
        "out_hidden_size": 2048,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
        "temporal_patch_size": 2,
    },
}


def test_published_config_reads_as_transformers_reads_it() -> None:
    from transformers import Qwen2_5_VLConfig

    from inferd.models.config import config_from_hf

    ref = Qwen2_5_VLConfig(**{k: v for k, v in PUBLISHED_CONFIG.items() if k != "architectures"})
    cfg = config_from_hf(PUBLISHED_CONFIG, has_lm_head=False)
    text, vision = ref.text_config, ref.vision_config
    assert cfg.qwen_vision is not None and cfg.attention_bias and cfg.sliding_window is None
    assert cfg.mrope_section == tuple(text.rope_parameters["mrope_section"])
    assert cfg.rope_theta == text.rope_parameters["rope_theta"] and cfg.tie_word_embeddings
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (
        text.hidden_size,
        text.num_hidden_layers,
        text.num_attention_heads,
        text.num_key_value_heads,
    )
    q = cfg.qwen_vision
    assert (q.num_layers, q.hidden_size, q.num_heads, q.out_hidden_size, q.window_size) == (
        vision.depth,
        vision.hidden_size,
        vision.num_heads,
        vision.out_hidden_size,
        vision.window_size,
    )
    assert q.fullatt_block_indexes == tuple(vision.fullatt_block_indexes)
    assert (q.image_token_id, q.video_token_id) == (ref.image_token_id, ref.video_token_id)
    assert cfg.input_modalities == ("text", "image", "video")
