"""`inferd serve` on a tiny random Qwen3-VL directory: /v1/models says it takes images and
videos, and an image and a video (MP4, ``video_url``) sent through the OpenAI SDK (strict) reach
the model as transformers' Qwen3-VL takes them: the video's frames sampled by its video
processor's settings, one run of placeholders per temporal patch after its timestamp. The
oracle: usage equal to transformers' prompt length and the greedy reply (and each token's
log-probability) equal to its generate on the same pixels, streamed and not; the same video
twice is encoded once (its temporal patches kept in the encoder cache). An image likewise
through the Anthropic and Responses APIs (neither has a video part)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from inferd.loading.hf_processor import read_qwen3_video_config, read_visual_configs
from inferd.media.video import decode_video
from inferd.models.config import config_from_hf
from inferd.models.qwen2_vl_image import prepare_image
from inferd.models.qwen3_vl_video import PreparedQwen3Video, Qwen3VideoConfig
from inferd.models.qwen3_vl_video import prepare_video as prepare_qwen3_video
from tests.media.corpus import Clip, _mp4
from tests.models.test_idefics3_processor import generated
from tests.models.test_qwen3_vl_parity import Media, expand_all, reference
from tests.server.live import LiveServer, live_server
from tests.server.media_replies import (
    Greedy,
    Reply,
    assert_greedy_reply,
    encoder_calls,
    greedy_chat,
    image_on_anthropic_and_responses,
    streamed_text,
    transformers_greedy,
)
from tests.server.test_vision_live import data_url, png_bytes

NEW = 8
LOGPROB_TOLERANCE = 1e-4  # float32 on both sides: only summation order differs
QUESTION = "What do the picture and the clip show?"


@pytest.fixture(scope="module")
def server(
    tiny_qwen3_vl: tuple[Path, Any, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("qwen3-vl-serve") / "serve.log"
    with live_server(["-m", str(tiny_qwen3_vl[0]), "--dtype", "f32"], log) as live:
        yield live


@pytest.fixture(scope="module")
def video_cfg(tiny_qwen3_vl: tuple[Path, Any, Any]) -> Qwen3VideoConfig:
    cfg = config_from_hf(json.loads((tiny_qwen3_vl[0] / "config.json").read_text()))
    found = read_qwen3_video_config(tiny_qwen3_vl[0], cfg)
    assert found is not None
    return found


def video_bytes() -> bytes:
    # 20 frames at 8 fps (2.5 s): 5 kept at 2 fps, padded to three temporal patches
    return _mp4(Clip(fps=Fraction(8), frames=20, size=(96, 64)), None)


def prepared_video(data: bytes, cfg: Qwen3VideoConfig) -> PreparedQwen3Video:
    """The frames transformers' video processor keeps, prepared as it prepares them (each
    step checked against its own code in tests/models/test_qwen3_vl_parity.py)."""
    decoded = decode_video(data, sampling=cfg)
    return prepare_qwen3_video(decoded.frames, decoded.frame_indices, decoded.fps, cfg)


def transformers_reply(
    tiny_qwen3_vl: tuple[Path, Any, Any], prepared: list[Media], question: str = QUESTION
) -> tuple[Greedy, str]:
    """transformers' greedy reply and its prompt text for the turn: the media (an image, then
    a video if given), then ``question``."""
    _, hf, processor = tiny_qwen3_vl
    tok = processor.tokenizer
    kinds = ["image", "video"][: len(prepared)]
    parts = [{"type": kind} for kind in kinds] + [{"type": "text", "text": question}]
    text = tok.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
    )
    expanded = expand_all(text, prepared)
    ids = tok(expanded)["input_ids"]
    inputs = reference(hf, ids, prepared) | {"attention_mask": torch.ones(1, len(ids))}
    return transformers_greedy(hf, inputs, tok, NEW), expanded


def _ask(client: openai.OpenAI, image: bytes, video: bytes, **more: Any) -> Any:
    parts = [
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        {"type": "video_url", "video_url": {"url": data_url(video, "video/mp4")}},
        {"type": "text", "text": QUESTION},
    ]
    return greedy_chat(client, parts, NEW, **more)


def test_models_lists_image_and_video_input(server: LiveServer) -> None:
    card = httpx.get(server.api + "/models", timeout=10).json()["data"][0]
    assert card["modalities"]["input"] == ["text", "image", "video"]


def test_an_image_and_a_video_reach_the_model_as_transformers_takes_them(
    client: openai.OpenAI,
    tiny_qwen3_vl: tuple[Path, Any, Any],
    video_cfg: Qwen3VideoConfig,
    server: LiveServer,
) -> None:
    directory = tiny_qwen3_vl[0]
    cfg = config_from_hf(json.loads((directory / "config.json").read_text()))
    configs = read_visual_configs(directory, cfg)
    assert configs is not None
    image = generated(90, 120, seed=41)
    video = video_bytes()
    prepared: list[Media] = [prepare_image(image, configs[0]), prepared_video(video, video_cfg)]
    assert len(prepared[1].seconds) == 3  # type: ignore[union-attr]
    expected, expanded = transformers_reply(tiny_qwen3_vl, prepared)
    assert re.findall(r"<([\d.]+) seconds>", expanded) == ["0.3", "1.5", "2.4"]

    reply = _ask(client, png_bytes(image), video, logprobs=True)
    assert_greedy_reply(reply, expected, LOGPROB_TOLERANCE)  # every run's placeholders, times

    calls_before = encoder_calls(server)
    assert streamed_text(_ask(client, png_bytes(image), video, stream=True)) == expected.text
    assert encoder_calls(server) == calls_before  # each temporal patch came from the cache


def test_an_image_reaches_the_model_on_the_anthropic_and_responses_apis(
    server: LiveServer, client: openai.OpenAI, tiny_qwen3_vl: tuple[Path, Any, Any]
) -> None:
    cfg = config_from_hf(json.loads((tiny_qwen3_vl[0] / "config.json").read_text()))
    configs = read_visual_configs(tiny_qwen3_vl[0], cfg)
    assert configs is not None
    image = generated(70, 130, seed=43)
    question = "Describe it."
    expected, _ = transformers_reply(tiny_qwen3_vl, [prepare_image(image, configs[0])], question)
    url = data_url(png_bytes(image))
    claude, responses, _ = image_on_anthropic_and_responses(server, client, url, question, NEW)
    assert claude == responses == Reply(len(expected.ids), expected.text)
