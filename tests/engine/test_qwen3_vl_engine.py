"""The engine on the tiny random Qwen3-VL checkpoint, media given as the engine takes them (an
image one ``MediaInput``, a video one per temporal patch: each is its own run of placeholders
between timestamps): greedy output equal to transformers' generate for images, a video, both,
and text alone, each prefilled in chunks that cut through the media, so the deep-stack rows
(carried as extra columns of the encoder's rows) pass through the runner, the encoder cache
and chunked prefill, and decode continues at ``p + delta``; a repeated image encoded once and
its prefix-cache blocks reused with the same output."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from inferd.config import EngineConfig
from inferd.engine.driver import CallerLoop
from inferd.engine.llm_engine import LLMEngine
from inferd.engine.request import MediaInput
from inferd.engine.sampling import SamplingParams
from inferd.loading.hf_processor import read_qwen3_video_config, read_visual_configs
from inferd.models.qwen2_vl_image import (
    PreparedVisual,
    QwenVisualConfig,
    prepare_image,
    visual_patches,
)
from inferd.models.qwen3_vl import Qwen3VLForCausalLM
from inferd.models.qwen3_vl_video import Qwen3VideoConfig
from inferd.serving.served import ServedModel, load_model
from tests.models.test_idefics3_processor import generated
from tests.models.test_qwen2_5_vl_parity import IMAGE, VIDEO
from tests.models.test_qwen3_vl_parity import Media, clip, expand_all, reference
from tests.models.tiny_qwen3_vl import save_tiny_qwen3_vl

CHUNK = 16  # tokens per step: every image and video here spans several steps
NEW = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    directory = tmp_path_factory.mktemp("qwen3_vl_engine")
    model, processor = save_tiny_qwen3_vl(directory)
    return directory, model, processor


@pytest.fixture(scope="module")
def served(tiny: tuple[Path, Any, Any]) -> Iterator[ServedModel]:
    cfg = EngineConfig(
        dtype="f32", max_num_batched_tokens=CHUNK, kv_cache_tokens=2048, max_model_len=1024
    )
    model = load_model(tiny[0], cfg, progress=False, loop=CallerLoop())
    yield model
    model.shutdown()


Configs = tuple[QwenVisualConfig, Qwen3VideoConfig]


@pytest.fixture(scope="module")
def configs(served: ServedModel, tiny: tuple[Path, Any, Any]) -> Configs:
    cfg = served.engine.engine.model_config
    images, video = read_visual_configs(tiny[0], cfg), read_qwen3_video_config(tiny[0], cfg)
    assert images is not None and video is not None
    return images[0], video


def patches_of(p: PreparedVisual) -> Callable[[torch.Tensor], torch.Tensor]:
    def expand(pixels: torch.Tensor) -> torch.Tensor:
        return visual_patches(pixels, p.cfg, p.modality)

    return expand


def media_inputs(ids: list[int], prepared: list[Media], model: Qwen3VLForCausalLM) -> list[Any]:
    """One MediaInput per run of placeholders, in prompt order (digests from the pixels)."""
    q, out, at = model.vision_config, [], 0
    for p in prepared:
        image = isinstance(p, PreparedVisual)
        runs = [p] if isinstance(p, PreparedVisual) else p.runs()
        token = q.image_token_id if image else q.video_token_id
        for run in runs:
            first = ids.index(token, at)
            at = first + run.num_embeddings
            digest = f"{run.modality}-{hash(run.pixels.numpy().tobytes())}"
            out.append(
                MediaInput(
                    digest,
                    tuple(range(first, at)),
                    run.pixels,
                    patches_of(run),
                    modality=run.modality,
                    grid=run.grid,
                )
            )
    return out


def run(engine: LLMEngine, rid: str, ids: list[int], media: list[MediaInput]) -> list[int]:
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)  # as generate runs
    engine.add_request(rid, ids, params, media=media)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.token_ids
    return tokens


def hf_greedy(hf: Any, ids: list[int], prepared: list[Media]) -> list[int]:
    inputs = reference(hf, ids, prepared)
    with torch.inference_mode():
        out = hf.generate(
            **inputs,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=NEW,
            do_sample=False,
        )
    return out[0, len(ids) :].tolist()


CASES = {
    "one image": (f"<|im_start|>user\n{IMAGE}What is this?<|im_end|>\n", ["cat"]),
    "two images": (f"First {IMAGE} then {IMAGE}: which is wider?", ["wide", "cat"]),
    "video": (f"<|im_start|>user\n{VIDEO}What happens?<|im_end|>\n", ["clip"]),
    "mixed": (f"Picture {IMAGE}, clip {VIDEO}, picture {IMAGE}.", ["cat", "clip", "wide"]),
    "text only": ("The quick brown fox jumps over the lazy dog.", []),
}


def prepare(names: list[str], configs: Configs) -> list[Media]:
    image_cfg, video_cfg = configs
    made: dict[str, Callable[[], Media]] = {
        "cat": lambda: prepare_image(generated(150, 100, seed=1), image_cfg),
        "wide": lambda: prepare_image(generated(60, 200, seed=2), image_cfg),
        "clip": lambda: clip(12, 6.0, 60, 90, video_cfg),
    }
    return [made[n]() for n in names]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_transformers_generate(
    case: str, served: ServedModel, tiny: tuple[Path, Any, Any], configs: Configs
) -> None:
    text, names = CASES[case]
    engine = served.engine.engine
    model = engine.model
    assert isinstance(model, Qwen3VLForCausalLM)
    prepared = prepare(names, configs)
    ids = tiny[2].tokenizer(expand_all(text, prepared))["input_ids"]
    assert len(ids) > CHUNK or not prepared  # the prefill runs in chunks that cut the media
    tokens = run(engine, f"greedy-{case}", ids, media_inputs(ids, prepared, model))
    assert tokens == hf_greedy(tiny[1], ids, prepared)


def test_a_repeated_image_is_encoded_once_and_its_prefix_reused(
    served: ServedModel, tiny: tuple[Path, Any, Any], configs: Configs
) -> None:
    """The same image asked twice: one encoder call over several chunks and two requests,
    the second request's blocks found in the prefix cache, the same greedy output (its
    deep-stack rows came from the encoder cache, then from cached keys and values)."""
    engine = served.engine.engine
    model = engine.model
    assert isinstance(model, Qwen3VLForCausalLM)
    text = f"{IMAGE} Describe the picture in one word, then in another one, please."
    prepared = [prepare_image(generated(90, 90, seed=11), configs[0])]
    ids = tiny[2].tokenizer(expand_all(text, prepared))["input_ids"]
    calls, hits = model.encoder_calls, engine.stats().prefix_cache_hits
    first = run(engine, "repeat-a", ids, media_inputs(ids, prepared, model))
    second = run(engine, "repeat-b", ids, media_inputs(ids, prepared, model))
    assert model.encoder_calls - calls == 1
    assert engine.stats().prefix_cache_hits > hits
    assert first == second == hf_greedy(tiny[1], ids, prepared)
