"""`inferd serve` on a tiny random Qwen3-VL-MoE directory (2 of 4 experts a token in two of
its three layers): the startup line names the experts, and an image sent through the OpenAI SDK
(strict) reaches the model as transformers' Qwen3VLMoeForConditionalGeneration takes it. The
oracle: usage equal to the processor's prompt length, the greedy reply equal to transformers'
generate on the same pixels, and each reply token's log-probability within 1e-4 of its
(float32 on both sides; a token routed to other experts would move it far more).

The experts are quantized as every other projection: `POST /re_isq` q8 on a second server makes
the weight bytes in /metrics drop by what the projections (experts included) save, to those of a
server started with `--isq q8`, whose startup line says so and whose greedy answer it gives."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from inferd.layers.linear import Linear, resident_bytes
from inferd.loading.hf_processor import read_visual_configs
from inferd.loading.model import load
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
EXPERTS_LINE = "experts    2 of 4 a token (24 wide) in 2 of 3 layers, 16 expert projections"
ADMIN_KEY = "admin-secret"
WEIGHT_BYTES = "inferd_model_weight_bytes"


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
    assert EXPERTS_LINE + "\n" in server.log.read_text()  # nothing says they stay dense
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


@dataclass(frozen=True)
class Requantized:
    before: float  # the weight bytes in /metrics, unquantized
    reply: dict[str, Any]  # /re_isq q8's answer
    after: float
    isq_q8: float  # those of the server started with --isq q8
    startup_q8: str  # its log
    answers: tuple[str, str]  # the re-quantized server's greedy answer, and the --isq q8 one's


def _answer(live: LiveServer) -> str:
    with openai.OpenAI(
        base_url=live.api, api_key="unused", max_retries=0, _strict_response_validation=True
    ) as client:
        reply = greedy_chat(client, [{"type": "text", "text": QUESTION}], NEW)
    return str(reply.choices[0].message.content)


@pytest.fixture(scope="module")
def requantized(tiny_qwen3_vl_moe: Tiny, tmp_path_factory: pytest.TempPathFactory) -> Requantized:
    tmp = tmp_path_factory.mktemp("qwen3-vl-moe-re-isq")
    common = ["-m", str(tiny_qwen3_vl_moe[0]), "--dtype", "f32"]
    with (
        live_server([*common, "--admin-key", ADMIN_KEY], tmp / "plain.log") as plain,
        live_server([*common, "--isq", "q8"], tmp / "isq_q8.log") as isq_q8,
    ):
        before = plain.metric(WEIGHT_BYTES)
        reply = httpx.post(
            f"{plain.url}/re_isq",
            json={"isq": "q8"},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=300,
        )
        assert reply.status_code == 200, reply.text
        return Requantized(
            before,
            reply.json(),
            plain.metric(WEIGHT_BYTES),
            isq_q8.metric(WEIGHT_BYTES),
            isq_q8.log.read_text(),
            (_answer(plain), _answer(isq_q8)),
        )


def _projection_bytes(model: Any, experts: bool) -> int:
    """The bytes of the model's projections (experts' or the others'): dense weights and
    packed copies."""
    return sum(
        t.numel() * t.element_size()
        for name, m in model.named_modules()
        if isinstance(m, Linear) and (".experts." in name) == experts
        for t in (m.weight, m._packed, m._scales)
        if t is not None
    )


def test_re_isq_quantizes_the_experts(tiny_qwen3_vl_moe: Tiny, requantized: Requantized) -> None:
    """The weight bytes drop by what q8 saves on every projection, the experts' included (as
    a load under --isq q8 holds them, in this process), to those of the --isq q8 server."""
    dense = load(str(tiny_qwen3_vl_moe[0]), dtype="f32", progress=False).model
    q8 = load(str(tiny_qwen3_vl_moe[0]), dtype="f32", isq="q8", progress=False).model
    experts_saved = _projection_bytes(dense, True) - _projection_bytes(q8, True)
    others_saved = _projection_bytes(dense, False) - _projection_bytes(q8, False)
    assert experts_saved > 0.7 * _projection_bytes(dense, True)  # 4 bytes a weight -> 1 (+ scales)
    assert resident_bytes(dense) - resident_bytes(q8) == experts_saved + others_saved
    r = requantized
    assert (r.reply["quantization"], r.reply["changed"]) == ("q8", True)
    assert r.before - r.after == experts_saved + others_saved
    assert r.after == r.reply["weight_bytes"] == r.isq_q8
    assert r.answers[0] == r.answers[1]


def test_the_startup_line_names_the_experts_quantization(requantized: Requantized) -> None:
    assert EXPERTS_LINE + " quantized q8 (--isq)\n" in requantized.startup_q8
