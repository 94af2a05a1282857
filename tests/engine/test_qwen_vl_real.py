"""The engine on the tiny random Qwen2.5-VL checkpoint: greedy output equal to transformers'
generate with one image, two images, a video, images and a video together, and text alone,
each prompt prefilled in chunks that cut through its media (M-RoPE positions carried through
chunks and into decode); a repeated image encoded once; the prefix cache keyed by the media;
media refused unless their grid fills their placeholders."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from inferd.config import EngineConfig
from inferd.engine.driver import CallerLoop
from inferd.engine.llm_engine import AdmissionError, LLMEngine
from inferd.engine.request import MediaInput
from inferd.engine.sampling import SamplingParams
from inferd.media.types import DecodedVideo
from inferd.models.qwen2_5_vl import Qwen2_5_VLForCausalLM
from inferd.serving.multimodal import ImageItem, MediaPromptError, image_digest, sampled_fps
from inferd.serving.served import ServedModel, load_model
from tests.models.test_idefics3_processor import generated
from tests.models.test_qwen2_5_vl_parity import IMAGE, VIDEO, frames

CHUNK = 16  # tokens per step: every image and video here spans several steps
NEW = 8


@pytest.fixture(scope="module")
def served(tiny_qwen2_5_vl: tuple[Path, Any, Any]) -> Iterator[ServedModel]:
    cfg = EngineConfig(
        dtype="f32", max_num_batched_tokens=CHUNK, kv_cache_tokens=2048, max_model_len=1024
    )
    model = load_model(tiny_qwen2_5_vl[0], cfg, progress=False, loop=CallerLoop())
    yield model
    model.shutdown()


def picture(height: int, width: int, seed: int) -> ImageItem:
    image = generated(height, width, seed=seed)
    return image, image_digest(image)


def clip(n: int, height: int, width: int, seed: int, fps: float = 4.0) -> DecodedVideo:
    """A decoded video of ``n`` frames sampled 1 in 2 from a stream at ``fps``."""
    data = frames(n, height, width, seed)
    return DecodedVideo(
        frames=data,
        frame_indices=tuple(range(0, 2 * n, 2)),
        timestamps=tuple(2 * i / fps for i in range(n)),
        fps=fps,
        total_frames=2 * n,
        duration=2 * n / fps,
        digest=hashlib.sha256(data.tobytes()).hexdigest(),
        format="MP4",
    )


def run(engine: LLMEngine, rid: str, ids: list[int], media: list[MediaInput]) -> list[int]:
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)  # as generate runs
    engine.add_request(rid, ids, params, media=media)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.token_ids
    return tokens


def reference(hf: Any, ids: list[int], media: list[MediaInput]) -> list[int]:
    """transformers' greedy continuation of the same ids and patches."""
    q = hf.config
    mm = [1 if i == q.image_token_id else 2 if i == q.video_token_id else 0 for i in ids]
    inputs: dict[str, Any] = {
        "input_ids": torch.tensor([ids]),
        "mm_token_type_ids": torch.tensor([mm]),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
    }
    for kind, values, grids in (
        ("image", "pixel_values", "image_grid_thw"),
        ("video", "pixel_values_videos", "video_grid_thw"),
    ):
        items = [m for m in media if m.modality == kind]
        if items:
            inputs[values] = torch.cat([m.encoder_input() for m in items])
            inputs[grids] = torch.tensor([m.grid for m in items])
    videos = [m for m in media if m.modality == "video"]
    if videos:
        tps = q.vision_config.tokens_per_second
        inputs["second_per_grid_ts"] = torch.tensor([m.rope_step / tps for m in videos])
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    return out[0, len(ids) :].tolist()


def encoder(served: ServedModel) -> Qwen2_5_VLForCausalLM:
    model = served.engine.engine.model
    assert isinstance(model, Qwen2_5_VLForCausalLM)
    return model


CAT = picture(150, 100, 1)
WIDE = picture(60, 200, 2)
CLIP = clip(4, 60, 90, 3)  # 4 frames at 2 fps: temporal patches 1 s apart


@pytest.mark.parametrize(
    ("text", "media"),
    [
        (f"<|im_start|>user\n{IMAGE}What is this?<|im_end|>\n", [CAT]),
        (f"First {IMAGE} then {IMAGE}: which is wider?", [WIDE, CAT]),
        (f"<|im_start|>user\n{VIDEO}What happens?<|im_end|>\n", [CLIP]),
        (f"Picture {IMAGE}, clip {VIDEO}, picture {IMAGE}.", [CAT, CLIP, WIDE]),
        ("The quick brown fox jumps over the lazy dog.", []),
    ],
    ids=["one image", "two images", "video", "mixed", "text only"],
)
def test_greedy_equals_transformers_generate(
    served: ServedModel, tiny_qwen2_5_vl: Any, text: str, media: list[Any]
) -> None:
    hf = tiny_qwen2_5_vl[1]
    ids, inputs = served.prompt(text, media)
    assert [m.modality for m in inputs] == [
        "video" if isinstance(m, DecodedVideo) else "image" for m in media
    ]
    assert len(ids) > CHUNK or not media  # the prefill runs in chunks that cut the media
    tokens = run(served.engine.engine, f"greedy-{len(ids)}-{len(media)}", ids, inputs)
    assert tokens == reference(hf, ids, inputs)


def test_sampled_fps_sets_the_temporal_step(served: ServedModel) -> None:
    assert sampled_fps(CLIP) == 2.0
    _, inputs = served.prompt(VIDEO, [CLIP])
    assert inputs[0].grid is not None and inputs[0].grid[0] == 2
    assert inputs[0].rope_step == 2.0  # 1 s a temporal patch at 2 tokens a second


def test_a_repeated_image_is_encoded_once(served: ServedModel) -> None:
    model, engine = encoder(served), served.engine.engine
    image = picture(80, 80, 7)
    before = model.encoder_calls
    for n, question in enumerate([f"{IMAGE}Where?", f"{IMAGE}And now, when?"]):
        ids, media = served.prompt(question, [image])
        run(engine, f"repeat-{n}", ids, media)
    assert model.encoder_calls - before == 1  # over several chunks and two requests


def test_prefix_cache_keys_blocks_by_media(served: ServedModel, tiny_qwen2_5_vl: Any) -> None:
    hf = tiny_qwen2_5_vl[1]
    engine = served.engine.engine
    text = f"{IMAGE} Describe the picture in one word, then in another one, please."
    first, second = picture(90, 90, 11), picture(90, 90, 12)  # same size: the same ids

    def ask(rid: str, image: ImageItem) -> tuple[list[int], list[int], int, list[MediaInput]]:
        hits = engine.stats().prefix_cache_hits
        ids, media = served.prompt(text, [image])
        tokens = run(engine, rid, ids, media)
        return ids, tokens, engine.stats().prefix_cache_hits - hits, media

    ids_a, a, hits_a, media_a = ask("prefix-a", first)
    ids_b, b, hits_b, media_b = ask("prefix-b", second)
    _, c, hits_c, _ = ask("prefix-c", first)
    assert ids_a == ids_b and hits_a == hits_b == 0 and hits_c > 0
    assert a == c == reference(hf, ids_a, media_a)
    assert b == reference(hf, ids_b, media_b)


def test_media_must_fill_their_placeholders(served: ServedModel) -> None:
    engine = served.engine.engine
    ids, media = served.prompt(f"{IMAGE}Hi", [CAT])
    m = media[0]
    assert m.grid is not None
    t, h, w = m.grid
    for grid in [(t, h + 2, w), (t, h, w - 1), None]:
        wrong = MediaInput(m.digest, m.positions, m.pixel_values, m.expand, "image", grid=grid)
        with pytest.raises(AdmissionError) as refused:
            engine.add_request("bad", ids, SamplingParams(max_tokens=1), media=[wrong])
        assert refused.value.code == "invalid_media"
    cut = MediaInput(m.digest, m.positions, m.pixel_values[..., :-14], m.expand, grid=m.grid)
    with pytest.raises(AdmissionError, match="do not match its grid"):
        engine.add_request("cut", ids, SamplingParams(max_tokens=1), media=[cut])
    with pytest.raises(MediaPromptError):
        served.prompt(f"{IMAGE} and {IMAGE}", [CAT])
    with pytest.raises(MediaPromptError):
        served.prompt(f"{IMAGE}", [CLIP])  # a video for an image marker
    assert served.modalities["input"] == ["text", "image", "video"]


def test_a_video_with_an_odd_frame_count_repeats_its_last(served: ServedModel) -> None:
    video = clip(3, 40, 40, 21)
    _, media = served.prompt(VIDEO, [video])
    pixels = media[0].pixel_values
    assert media[0].grid is not None and media[0].grid[0] == 2
    assert torch.equal(pixels[3], pixels[2])
    assert not torch.equal(pixels[1], pixels[2])
    assert np.asarray(video.frames).shape[0] == 3


def test_requests_batched_together_keep_their_own_positions(
    served: ServedModel, tiny_qwen2_5_vl: Any
) -> None:
    """An image request, a video request and a text request in the same steps (one's decode
    beside another's prefill): each equals transformers' greedy output alone."""
    hf, engine = tiny_qwen2_5_vl[1], served.engine.engine
    prompts = [
        (f"{IMAGE} Say what you see.", [WIDE]),
        (f"Watch {VIDEO} closely, then say it.", [clip(4, 40, 100, 31)]),
        ("Only words here, nothing else at all.", []),
    ]
    jobs = [served.prompt(text, media) for text, media in prompts]
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    for n, (ids, media) in enumerate(jobs):
        engine.add_request(f"batch-{n}", ids, params, media=media)
    tokens: dict[str, list[int]] = {f"batch-{n}": [] for n in range(len(jobs))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
    for n, (ids, media) in enumerate(jobs):
        assert tokens[f"batch-{n}"] == reference(hf, ids, media)


def test_llm_chat_takes_image_parts(served: ServedModel, tiny_qwen2_5_vl: Any) -> None:
    """``LLM.chat`` with an image part on a grid model: the prompt ``ServedModel.chat_prompt``
    makes of the same conversation, and transformers' greedy continuation of it."""
    from inferd import LLM

    question = {"type": "text", "text": "What is this?"}
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    with LLM(tiny_qwen2_5_vl[0], dtype="f32", kv_cache_tokens=2048, max_model_len=1024) as llm:
        parts = [{"type": "image", "image": CAT[0]}, question]
        out = llm.chat([{"role": "user", "content": parts}], params)[0]
    template = [{"role": "user", "content": [{"type": "image"}, question]}]
    ids, inputs = served.chat_prompt(template, [CAT])
    assert out.prompt_token_ids == ids
    assert list(out.outputs[0].token_ids) == reference(tiny_qwen2_5_vl[1], ids, inputs)
