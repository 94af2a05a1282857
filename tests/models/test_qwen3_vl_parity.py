"""Our Qwen3-VL against transformers on the tiny random checkpoint (f32): the config read from
it, the logits of every position for text alone, one image and two images (deep-stack rows
added in the first decoder layers, interleaved M-RoPE positions equal to transformers'
``get_rope_index``), greedy tokens, the encoder's main and deep-stack rows for grids that
resample the learned position grid up and down, a prefill cut into chunks through an image,
and the image processor's patches, grids and token counts bit-equal to transformers'."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from inferd.loading.hf_model import load_safetensors_model
from inferd.loading.hf_processor import read_qwen3_video_config, read_visual_configs
from inferd.models.config import ModelConfigError, config_from_hf
from inferd.models.qwen2_vl_image import (
    IMAGE_PAD,
    VIDEO_PAD,
    PreparedVisual,
    QwenVisualConfig,
    image_tokens,
    prepare_image,
)
from inferd.models.qwen3_vl import Qwen3VLForCausalLM
from inferd.models.qwen3_vl_video import PreparedQwen3Video, Qwen3VideoConfig, video_size
from inferd.models.qwen3_vl_video import prepare_video as prepare_qwen3_video
from tests.models.paged import paged_logits
from tests.models.test_idefics3_processor import generated
from tests.models.test_qwen2_5_vl_parity import IMAGE, VIDEO, expand, frames
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


@pytest.fixture(scope="module")
def video_cfg(tiny: tuple[Path, Any, Any]) -> Qwen3VideoConfig:
    cfg = config_from_hf(json.loads((tiny[0] / "config.json").read_text()))
    found = read_qwen3_video_config(tiny[0], cfg)
    assert found is not None
    return found


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


Media = PreparedVisual | PreparedQwen3Video


def our_inputs(
    model: Qwen3VLForCausalLM, ids: list[int], prepared: list[Media]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (wide) embeddings with the encoder's rows over the placeholders, and the M-RoPE
    positions: an image is one run of placeholders, a video one run per temporal patch."""
    x = model.embed(torch.tensor(ids)).clone()
    spans, at = [], 0
    q = model.vision_config
    with torch.inference_mode():
        for p in prepared:
            whole = p if isinstance(p, PreparedVisual) else p.visual
            rows = model.encode_grids(whole.patches, [whole.grid])[0]
            runs = [whole] if isinstance(p, PreparedVisual) else p.runs()
            token = q.image_token_id if isinstance(p, PreparedVisual) else q.video_token_id
            for run, part in zip(runs, rows.split(runs[0].num_embeddings), strict=True):
                first = ids.index(token, at)
                at = first + run.num_embeddings
                assert ids[first:at] == [token] * run.num_embeddings
                x[first:at] = part
                spans.append((first, run.grid, 0.0))
    return x, model.rope_index(len(ids), spans)


def reference(hf: Any, ids: list[int], prepared: list[Media]) -> dict[str, Any]:
    q = hf.config
    mm = [1 if i == q.image_token_id else 2 if i == q.video_token_id else 0 for i in ids]
    inputs: dict[str, Any] = {
        "input_ids": torch.tensor([ids]),
        "mm_token_type_ids": torch.tensor([mm]),
    }
    images = [p for p in prepared if isinstance(p, PreparedVisual)]
    videos = [p.visual for p in prepared if isinstance(p, PreparedQwen3Video)]
    if images:
        inputs["pixel_values"] = torch.cat([p.patches for p in images])
        inputs["image_grid_thw"] = torch.tensor([p.grid for p in images])
    if videos:
        inputs["pixel_values_videos"] = torch.cat([p.patches for p in videos])
        inputs["video_grid_thw"] = torch.tensor([p.grid for p in videos])
    return inputs


def clip(total: int, fps: float, height: int, width: int, cfg: Qwen3VideoConfig) -> Any:
    """A generated clip of ``total`` frames at ``fps``, sampled and prepared as Qwen3-VL's
    processor does."""
    indices = cfg.indices(total, total / fps, fps)
    return prepare_qwen3_video(frames(total, height, width, 7)[indices], indices, fps, cfg)


def expand_all(text: str, prepared: list[Media]) -> str:
    """The processor's expansion: an image's pad repeated per row, a video's pad replaced by
    its timestamped runs."""
    out, rest = "", text
    for p in prepared:
        marker = IMAGE_PAD if isinstance(p, PreparedVisual) else VIDEO_PAD
        head, _, rest = rest.partition(marker)
        out += head + p.prompt_text()
    return out + rest


CASES: dict[str, tuple[str, list[tuple[Any, ...]]]] = {
    "text only": ("<|im_start|>user\nThe quick brown fox jumps over the lazy dog.", []),
    "one image": (
        f"<|im_start|>user\n{IMAGE}What is in the picture?<|im_end|>\n",
        [("image", 150, 100, 1)],
    ),
    "two images": (
        f"<|im_start|>user\nFirst {IMAGE} and second {IMAGE}: which is wider?",
        [("image", 60, 200, 2), ("image", 90, 70, 3)],
    ),
    # 12 frames at 6 fps: 4 kept (0, 4, 7, 11), two temporal patches at 0.3 s and 1.5 s.
    "one video": (
        f"<|im_start|>user\n{VIDEO}What happens in the clip?<|im_end|>\n",
        [("video", 12, 6.0, 60, 90)],
    ),
    # 25 frames at 5 fps: 8 kept (the cap), four temporal patches; then an image.
    "video and image": (
        f"<|im_start|>user\n{VIDEO} then {IMAGE}: same scene?",
        [("video", 25, 5.0, 80, 50), ("image", 70, 120, 5)],
    ),
}


def case_inputs(
    case: str, ours: Setup, processor: Any, video_cfg: Qwen3VideoConfig
) -> tuple[list[int], list[Media]]:
    text, specs = CASES[case]
    prepared: list[Media] = [
        prepare_image(generated(s[1], s[2], seed=s[3]), ours[1])
        if s[0] == "image"
        else clip(*s[1:], video_cfg)
        for s in specs
    ]
    return processor.tokenizer(expand_all(text, prepared))["input_ids"], prepared


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(
    case: str, ours: Setup, tiny: tuple[Path, Any, Any], video_cfg: Qwen3VideoConfig
) -> None:
    model = ours[0]
    _, hf, processor = tiny
    ids, prepared = case_inputs(case, ours, processor, video_cfg)
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


@pytest.mark.parametrize("case", ["text only", "two images", "video and image"])
def test_greedy_tokens_match_transformers(
    case: str, ours: Setup, tiny: tuple[Path, Any, Any], video_cfg: Qwen3VideoConfig
) -> None:
    assert_greedy_tokens_match(case, ours, tiny, video_cfg)


def assert_greedy_tokens_match(
    case: str, ours: Setup, tiny: tuple[Path, Any, Any], video_cfg: Qwen3VideoConfig
) -> None:
    """Six greedy tokens; ours re-run whole each step, the tokens after the prompt at
    ``p + delta`` on all three axes (what the runner gives them)."""
    model = ours[0]
    _, hf, processor = tiny
    ids, prepared = case_inputs(case, ours, processor, video_cfg)
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


def test_a_run_of_several_temporal_patches_is_laid_out_frame_after_frame(ours: Setup) -> None:
    """A video given as one run (no timestamps between its frames) gets the positions of
    its temporal patches as adjacent runs, never a temporal axis of its own."""
    model = ours[0]
    together = model.rope_index(40, [(3, (3, 4, 6), 2.0)])
    apart = model.rope_index(40, [(3, (1, 4, 6), 0.0), (9, (1, 4, 6), 0.0), (15, (1, 4, 6), 0.0)])
    assert torch.equal(together, apart)
    # text from 3 + 3 runs advancing max(2, 3) merged rows and columns each
    assert together[:, 21:].tolist() == [list(range(12, 31))] * 3


def test_a_video_encodes_frame_by_frame(ours: Setup, video_cfg: Qwen3VideoConfig) -> None:
    """Each temporal patch alone (grid t = 1, one run of the prompt) gives the rows it has in
    the whole video: the engine may encode and cache them apart."""
    model = ours[0]
    video = clip(25, 5.0, 80, 50, video_cfg)
    with torch.inference_mode():
        whole = model.encode_grids(video.visual.patches, [video.visual.grid])[0]
        runs = [model.encode_grids(r.patches, [r.grid])[0] for r in video.runs()]
    assert len(runs) == video.visual.grid[0] == 4
    torch.testing.assert_close(torch.cat(runs), whole, atol=1e-5, rtol=1e-5)


VIDEOS = [  # (frames in the stream, its fps, height, width)
    (12, 6.0, 60, 90),
    (25, 5.0, 80, 50),
    (3, 0.0, 40, 40),  # fewer frames than min_frames, rate unknown (24 assumed)
    (100, 30.0, 20, 300),  # thin: scaled up to the patch group first
    (9, 2.0, 400, 500),  # large: scaled down to the bounds over all frames
    (7, 3.0, 64, 64),  # an odd count: the last frame repeated
]


@pytest.mark.parametrize(("total", "fps", "height", "width"), VIDEOS)
def test_video_processing_matches_transformers(
    total: int, fps: float, height: int, width: int, video_cfg: Qwen3VideoConfig
) -> None:
    """The frames sampled, the size, the patches (normalized and laid out) and the prompt
    text with its timestamps, each against transformers' own Qwen3-VL code (called on
    stand-ins for its objects: its video processor class cannot be built without
    torchvision)."""
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
        Qwen3VLVideoProcessor,
        smart_resize,
    )
    from transformers.video_utils import VideoMetadata

    settings = SimpleNamespace(fps=2, min_frames=4, max_frames=8)
    metadata = VideoMetadata(total_num_frames=total, fps=fps or None)
    indices = video_cfg.indices(total, total / fps if fps else 0.0, fps)
    ref_indices = Qwen3VLVideoProcessor.sample_frames(settings, metadata)  # type: ignore[arg-type]
    assert indices == ref_indices.tolist()
    v = video_cfg.visual
    size = smart_resize(
        len(indices), height, width, 2, factor=32, min_pixels=v.min_pixels, max_pixels=v.max_pixels
    )
    assert video_size(len(indices), height, width, v) == size
    video = prepare_qwen3_video(frames(total, height, width, 3)[indices], indices, fps, video_cfg)
    assert video.visual.pixels.shape[2:] == size
    sampled = video.visual.pixels[: len(indices)].float()
    normalized = (sampled - 127.5) / 127.5  # the fused step: (x - 255 mean) / (255 std)
    ref_patches, *grid = Qwen3VLVideoProcessor.patchify(
        None,  # type: ignore[arg-type]
        normalized[None],
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
    )
    assert tuple(grid) == video.visual.grid
    assert torch.equal(video.visual.patches, ref_patches[0])
    processor = SimpleNamespace(
        video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
        video_token=VIDEO_PAD,
        vision_start_token="<|vision_start|>",
        vision_end_token="<|vision_end|>",
        _calculate_timestamps=partial(Qwen3VLProcessor._calculate_timestamps, None),
    )
    metadata.frames_indices = np.array(indices)
    rendered = Qwen3VLProcessor.replace_video_token(
        processor,  # type: ignore[arg-type]
        {"video_grid_thw": torch.tensor([grid]), "video_metadata": [metadata]},
        0,
    )
    assert video.prompt_text() == rendered


# Qwen/Qwen3-VL-2B-Instruct's config.json as published (transformers 4.57: ``rope_scaling``
# and ``rope_theta`` in the text config, embeddings tied).
PUBLISHED_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "image_token_id": 151655,
    "model_type": "qwen3_vl",
    "text_config": {
        "attention_bias": False,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_text",
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "mrope_interleaved": True,
            "mrope_section": [24, 20, 20],
            "rope_type": "default",
        },
        "rope_theta": 5000000,
        "tie_word_embeddings": True,
        "vocab_size": 151936,
    },
    "tie_word_embeddings": True,
    "video_token_id": 151656,
    "vision_config": {
        "deepstack_visual_indexes": [5, 11, 17],
        "depth": 24,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1024,
        "in_channels": 3,
        "intermediate_size": 4096,
        "model_type": "qwen3_vl",
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 2048,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    "vision_end_token_id": 151653,
    "vision_start_token_id": 151652,
}


def test_published_config_reads_as_transformers_does() -> None:
    from transformers import Qwen3VLConfig

    ref = Qwen3VLConfig(**PUBLISHED_CONFIG)
    cfg = config_from_hf(PUBLISHED_CONFIG, has_lm_head=False)
    text, vision = ref.text_config, ref.vision_config
    assert cfg.architecture == "qwen3_vl" and cfg.tie_word_embeddings and cfg.qk_norm
    assert cfg.mrope_section == tuple(text.rope_parameters["mrope_section"])
    assert cfg.rope_theta == text.rope_parameters["rope_theta"] == 5000000
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        text.hidden_size,
        text.num_hidden_layers,
        text.num_attention_heads,
        text.num_key_value_heads,
        text.head_dim,
    )
    assert cfg.max_position == text.max_position_embeddings and cfg.sliding_window is None
    q = cfg.qwen_vision
    assert q is not None
    assert (q.num_layers, q.hidden_size, q.num_heads, q.out_hidden_size, q.patch_size) == (
        vision.depth,
        vision.hidden_size,
        vision.num_heads,
        vision.out_hidden_size,
        vision.patch_size,
    )
    assert q.deepstack_indexes == tuple(vision.deepstack_visual_indexes)
    assert q.num_position_embeddings == vision.num_position_embeddings
    assert (q.image_token_id, q.video_token_id) == (ref.image_token_id, ref.video_token_id)


def _broken(**changes: Any) -> dict[str, Any]:
    """The published config with parts of its text or vision config replaced (None: removed)."""
    out = json.loads(json.dumps(PUBLISHED_CONFIG))
    for path, value in changes.items():
        part, _, key = path.partition("__")
        if value is None:
            out[part].pop(key)
        else:
            out[part][key] = value
    return out


@pytest.mark.parametrize(
    ("hf", "message"),
    [
        ({k: v for k, v in PUBLISHED_CONFIG.items() if k != "vision_config"}, "vision_config"),
        (_broken(text_config__rope_scaling=None), "mrope_section"),
        (_broken(text_config__rope_scaling={"mrope_section": [24, 20, 21]}), "head_dim"),
        (_broken(vision_config__deepstack_visual_indexes=[5, 24]), "deepstack"),
        (_broken(vision_config__num_position_embeddings=2300), "square"),
        (_broken(vision_config__hidden_act="relu"), "activation"),
        (
            _broken(
                text_config__use_sliding_window=True,
                text_config__sliding_window=64,
                text_config__max_window_layers=0,
            ),
            "sliding",
        ),
        (_broken(vision_config__out_hidden_size=1024), "out_hidden_size"),
    ],
)
def test_a_broken_config_is_refused_clearly(hf: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        config_from_hf(hf)
