"""`inferd serve` on a tiny random Qwen3-VL-MoE directory (2 of 4 experts a token in two of
its three layers): the startup line names the experts, and an image sent through the OpenAI SDK
(strict) reaches the model as transformers' Qwen3VLMoeForConditionalGeneration takes it. The
oracle: usage equal to the processor's prompt length, the greedy reply equal to transformers'
generate on the same pixels, and each reply token's log-probability within 1e-4 of its
(float32 on both sides; a token routed to other experts would move it far more)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from inferd.loading.hf_processor import read_visual_configs
from inferd.models.config import config_from_hf
from inferd.models.qwen2_vl_image import prepare_image
from tests.models.test_idefics3_processor import generated
from tests.server.live import LiveServer, live_server
from tests.server.media_replies import assert_greedy_reply, greedy_chat
from tests.server.test_qwen3_vl_live import NEW, transformers_reply
from tests.server.test_vision_live import data_url, png_bytes

LOGPROB_TOLERANCE = 1e-4
QUESTION = "What is in the picture?"
Tiny = tuple[Path, Any, Any]


@pytest.fixture(scope="module")
def server(
    tiny_qwen3_vl_moe: Tiny, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("qwen3-vl-moe-serve") / "serve.log"
    with live_server(["-m", str(tiny_qwen3_vl_moe[0]), "--dtype", "f32"], log) as live:
        yield live


def test_an_image_reaches_the_experts_as_transformers_takes_it(
    client: openai.OpenAI, tiny_qwen3_vl_moe: Tiny, server: LiveServer
) -> None:
    assert "experts    2 of 4 a token (24 wide) in 2 of 3 layers" in server.log.read_text()
    directory = tiny_qwen3_vl_moe[0]
    configs = read_visual_configs(
        directory, config_from_hf(json.loads((directory / "config.json").read_text()))
    )
    assert configs is not None
    image = generated(90, 120, seed=47)
    expected, _ = transformers_reply(
        tiny_qwen3_vl_moe, [prepare_image(image, configs[0])], QUESTION
    )
    parts: Any = [
        {"type": "image_url", "image_url": {"url": data_url(png_bytes(image))}},
        {"type": "text", "text": QUESTION},
    ]
    reply = greedy_chat(client, parts, NEW, logprobs=True)
    assert_greedy_reply(reply, expected, LOGPROB_TOLERANCE)
