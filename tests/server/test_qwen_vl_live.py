"""`inferd serve` on a Hugging Face Qwen2.5-VL directory: /v1/models says it takes images and
videos, and an ``image_url`` part and a ``video_url`` part (the extension vLLM and mistral.rs
accept) sent through the OpenAI SDK (strict) reach the model: greedy output equal to
transformers' generate on the same pixels, usage counting their placeholder tokens; an
Anthropic ``image`` block likewise; a video outside a user turn refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import torch

from inferd.loading.hf_processor import read_visual_configs
from inferd.media.video import decode_video
from inferd.models.config import config_from_hf
from inferd.models.qwen2_vl_image import PreparedVisual, prepare_image, prepare_video
from inferd.serving.multimodal import sampled_fps
from tests.media.corpus import Clip, _mp4
from tests.models.test_idefics3_processor import generated
from tests.models.test_qwen2_5_vl_parity import expand
from tests.server.live import LiveServer, live_server
from tests.server.test_vision_live import data_url, png_bytes

NEW = 8


@pytest.fixture(scope="module")
def server(
    tiny_qwen2_5_vl: tuple[Path, Any, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("qwen-vl-serve") / "serve.log"
    with live_server(["-m", str(tiny_qwen2_5_vl[0]), "--dtype", "f32"], log) as live:
        yield live


@pytest.fixture(scope="module")
def oai(server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=server.api, api_key="unused", max_retries=0, _strict_response_validation=True
    ) as client:
        yield client


@pytest.fixture(scope="module")
def model_id(server: LiveServer) -> str:
    return str(httpx.get(server.api + "/models", timeout=10).json()["data"][0]["id"])


def reference(
    tiny: tuple[Path, Any, Any], parts: list[dict[str, Any]], prepared: list[PreparedVisual]
) -> tuple[int, str]:
    """transformers' prompt length and greedy reply for the turn, on our patches (equal to
    its processor's: tests/models/test_qwen2_vl_processor.py)."""
    _, hf, processor = tiny
    tok = processor.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(expand(text, prepared))["input_ids"]
    q = hf.config
    mm = [1 if i == q.image_token_id else 2 if i == q.video_token_id else 0 for i in ids]
    inputs: dict[str, Any] = {
        "input_ids": torch.tensor([ids]),
        "mm_token_type_ids": torch.tensor([mm]),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
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
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    return len(ids), tok.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True)


def test_models_lists_image_and_video_input(server: LiveServer) -> None:
    card = httpx.get(server.api + "/models", timeout=10).json()["data"][0]
    assert card["modalities"]["input"] == ["text", "image", "video"]


def test_an_image_and_a_video_reach_the_model(
    oai: openai.OpenAI, model_id: str, tiny_qwen2_5_vl: tuple[Path, Any, Any]
) -> None:
    directory = tiny_qwen2_5_vl[0]
    cfg = config_from_hf(json.loads((directory / "config.json").read_text()))
    configs = read_visual_configs(directory, cfg)
    assert configs is not None
    image = generated(90, 120, seed=41)
    # 2 s: 4 frames sampled at 2 fps, two temporal patches at positions 0 and 2; 96x64 px
    # resize to 84x56, 3x2 merged tokens a patch. (The text after a video resumes one past its
    # largest position; transformers' prompt resumes after its widest side instead, the same
    # here, where the side is the larger.)
    clip = Clip(fps=Fraction(8), frames=16, size=(96, 64))
    video_bytes = _mp4(clip, None)
    decoded = decode_video(video_bytes)
    prepared = [
        prepare_image(image, configs[0]),
        prepare_video(decoded.frames, sampled_fps(decoded), configs[1]),
    ]
    assert prepared[1].grid[0] == 2
    question = "What do the picture and the clip show?"
    template_parts = [{"type": "image"}, {"type": "video"}, {"type": "text", "text": question}]
    prompt_tokens, text = reference(tiny_qwen2_5_vl, template_parts, prepared)
    parts: Any = [
        {"type": "image_url", "image_url": {"url": data_url(png_bytes(image))}},
        {"type": "video_url", "video_url": {"url": data_url(video_bytes, "video/mp4")}},
        {"type": "text", "text": question},
    ]
    reply = oai.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": parts}],
        max_tokens=NEW,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == prompt_tokens  # the media's placeholders counted
    assert reply.choices[0].message.content == text


def test_a_video_outside_a_user_turn_is_refused(oai: openai.OpenAI, model_id: str) -> None:
    video = data_url(_mp4(Clip(fps=Fraction(8), frames=4, size=(64, 48)), None), "video/mp4")
    part: Any = {"type": "video_url", "video_url": {"url": video}}
    messages: Any = [
        {"role": "system", "content": [part]},
        {"role": "user", "content": "Hi"},
    ]
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model=model_id, messages=messages, max_tokens=1)
    assert "videos are accepted in user messages only" in caught.value.message


def test_anthropic_image_block_reaches_the_model(
    server: LiveServer, model_id: str, tiny_qwen2_5_vl: tuple[Path, Any, Any]
) -> None:
    directory = tiny_qwen2_5_vl[0]
    cfg = config_from_hf(json.loads((directory / "config.json").read_text()))
    configs = read_visual_configs(directory, cfg)
    assert configs is not None
    image = generated(70, 130, seed=43)
    question = "Describe it."
    parts = [{"type": "image"}, {"type": "text", "text": question}]
    prompt_tokens, text = reference(tiny_qwen2_5_vl, parts, [prepare_image(image, configs[0])])
    source = {"type": "base64", "media_type": "image/png", "data": data_url(png_bytes(image))}
    source["data"] = source["data"].split(",", 1)[1]
    messages: Any = [
        {
            "role": "user",
            "content": [{"type": "image", "source": source}, {"type": "text", "text": question}],
        }
    ]
    with anthropic.Anthropic(
        base_url=server.url, api_key="unused", max_retries=0, _strict_response_validation=True
    ) as claude:
        msg = claude.messages.create(
            model=model_id,
            max_tokens=NEW,
            messages=messages,
            extra_body={"temperature": 0, "ignore_eos": True},
        )
        counted = claude.messages.count_tokens(model=model_id, messages=messages)
    assert msg.usage.input_tokens == counted.input_tokens == prompt_tokens
    assert "".join(b.text for b in msg.content if b.type == "text") == text
