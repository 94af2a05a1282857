"""`inferd serve -m lm.gguf --mmproj mmproj.gguf`: the tiny random Qwen3-VL as llama.cpp's own
converter writes it (tests/models/tiny_qwen3_vl.py, tests/models/llama_cpp_convert.py). The
startup line names the projector and what its encoder takes, /v1/models lists image and video
input, and a PNG and an MP4 with text, sent through the strict OpenAI SDK, get transformers'
greedy reply on the checkpoint the files came from: usage equal to transformers' prompt (its
chat template, which the GGUF carries, each image's and each temporal patch's tokens after its
timestamp) and each reply token's log-probability, streamed and not. A projector whose encoder
gives another width than the language model's stops the command before it serves, with the
reason."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from inferd.cli import main
from inferd.loading.hf_processor import read_qwen3_video_config, read_visual_configs
from inferd.models.config import config_from_hf
from inferd.models.qwen2_vl_image import prepare_image
from tests.contract.altered_gguf import rewrite
from tests.models.test_idefics3_processor import generated
from tests.models.test_qwen3_vl_parity import Media
from tests.models.tiny_qwen3_vl import TinyQwen3VLGguf
from tests.server.live import LiveServer, live_server
from tests.server.media_replies import assert_greedy_reply, greedy_chat, streamed_text
from tests.server.test_qwen3_vl_live import (
    LOGPROB_TOLERANCE,
    NEW,
    QUESTION,
    prepared_video,
    transformers_reply,
    video_bytes,
)
from tests.server.test_vision_live import data_url, png_bytes


@pytest.fixture(scope="module")
def server(
    tiny_qwen3_vl_gguf: TinyQwen3VLGguf, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    files = tiny_qwen3_vl_gguf.files
    log = tmp_path_factory.mktemp("qwen3-vl-gguf-serve") / "serve.log"
    args = ["-m", str(files["lm-f16"]), "--mmproj", str(files["mmproj-f32"]), "--dtype", "f32"]
    with live_server(args, log) as live:
        yield live


def test_startup_names_the_projector_and_models_lists_its_media(
    server: LiveServer, tiny_qwen3_vl_gguf: TinyQwen3VLGguf
) -> None:
    line = next(x for x in server.log.read_text().splitlines() if "projector " in x)
    assert str(tiny_qwen3_vl_gguf.files["mmproj-f32"]) in line
    assert (
        "qwen3vl: image encoder 3 layers, hidden 32, deep stack from blocks 0, 1; 16 px patches "
        "merged 2x2; images of 65536 to 16777216 px, videos of 4096 to 25165824 px over their "
        "frames at 2 fps" in line
    )
    card = httpx.get(server.api + "/models", timeout=10).json()["data"][0]
    assert card["id"] == "lm-f16"
    assert card["modalities"]["input"] == ["text", "image", "video"]


def _ask(client: openai.OpenAI, image: bytes, video: bytes, **more: Any) -> Any:
    parts = [
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        {"type": "video_url", "video_url": {"url": data_url(video, "video/mp4")}},
        {"type": "text", "text": QUESTION},
    ]
    return greedy_chat(client, parts, NEW, model="lm-f16", **more)


def test_a_png_and_an_mp4_get_the_transformers_reply(
    client: openai.OpenAI, tiny_qwen3_vl_gguf: TinyQwen3VLGguf
) -> None:
    directory = tiny_qwen3_vl_gguf.directory
    cfg = config_from_hf(json.loads((directory / "config.json").read_text()))
    images, videos = read_visual_configs(directory, cfg), read_qwen3_video_config(directory, cfg)
    assert images is not None and videos is not None
    image, video = generated(90, 120, seed=73), video_bytes()
    prepared: list[Media] = [prepare_image(image, images[0]), prepared_video(video, videos)]
    # its prompt: the chat template the GGUF carries, each medium's tokens
    expected, _ = transformers_reply(tiny_qwen3_vl_gguf.tiny, prepared)
    reply = _ask(client, png_bytes(image), video, logprobs=True)
    assert_greedy_reply(reply, expected, LOGPROB_TOLERANCE)
    assert reply.usage.completion_tokens == NEW
    assert streamed_text(_ask(client, png_bytes(image), video, stream=True)) == expected.text


def test_a_projector_that_does_not_fit_stops_serve(
    tiny_qwen3_vl_gguf: TinyQwen3VLGguf, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = tiny_qwen3_vl_gguf.files
    narrow = rewrite(
        files["lm-f32"], tmp_path / "narrow.gguf", metadata={"qwen3vl.embedding_length": 48}
    )
    args = ["serve", "-m", str(narrow), "--mmproj", str(files["mmproj-f32"]), "--port", "0"]
    assert main(args) == 2
    err = capsys.readouterr()
    assert "encoder gives 64-wide embeddings; the language model is 48 wide" in err.err
    assert "listening" not in err.out
