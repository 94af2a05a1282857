"""`inferd serve -m lm.gguf --mmproj mmproj.gguf`: the tiny random Gemma 4 as llama.cpp's own
converter writes it (tests/models/tiny_gemma4.py, tests/models/llama_cpp_convert.py). The
startup line names the projector and what its encoders take, /v1/models lists image, video and
audio input, and a PNG and a WAV with text, sent through the strict OpenAI SDK, get
transformers' greedy reply on the checkpoint the files came from: usage equal to transformers'
prompt (its chat template, which the GGUF carries, and each medium's tokens) and each reply
token's log-probability, streamed and not. A projector whose encoders give another width than
the language model's stops the command before it serves, with the reason."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from inferd.cli import main
from tests.contract.altered_gguf import rewrite
from tests.media.corpus import wav_bytes
from tests.models.test_idefics3_processor import generated
from tests.models.tiny_gemma4 import TinyGemma4Gguf
from tests.server.live import LiveServer, live_server
from tests.server.media_replies import assert_greedy_reply, greedy_chat, streamed_text, wav_part
from tests.server.test_gemma4_live import LOGPROB_TOLERANCE, NEW, TONE, reference
from tests.server.test_vision_live import data_url, png_bytes

QUESTION = "What do the picture and the sound show?"


@pytest.fixture(scope="module")
def server(
    tiny_gemma4_gguf: TinyGemma4Gguf, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    files = tiny_gemma4_gguf.files
    log = tmp_path_factory.mktemp("gemma4-gguf-serve") / "serve.log"
    args = ["-m", str(files["lm-f16"]), "--mmproj", str(files["mmproj-f32"]), "--dtype", "f32"]
    with live_server(args, log) as live:
        yield live


def test_startup_names_the_projector_and_models_lists_its_media(
    server: LiveServer, tiny_gemma4_gguf: TinyGemma4Gguf
) -> None:
    line = next(x for x in server.log.read_text().splitlines() if "projector " in x)
    assert str(tiny_gemma4_gguf.files["mmproj-f32"]) in line
    assert "gemma4: images of up to 280 tokens (4 px patches pooled 3x3)" in line
    assert "videos of 32 frames of up to 70 tokens; audio as 16 mel bins" in line
    card = httpx.get(server.api + "/models", timeout=10).json()["data"][0]
    assert card["id"] == "lm-f16"
    assert card["modalities"]["input"] == ["text", "image", "video", "audio"]


def _ask(client: openai.OpenAI, picture: bytes, **more: Any) -> Any:
    parts = [
        {"type": "image_url", "image_url": {"url": data_url(picture)}},
        wav_part(wav_bytes(TONE)),
        {"type": "text", "text": QUESTION},
    ]
    return greedy_chat(client, parts, NEW, model="lm-f16", **more)


def test_a_png_and_a_wav_get_the_transformers_reply(
    client: openai.OpenAI, tiny_gemma4_gguf: TinyGemma4Gguf
) -> None:
    picture = generated(30, 44, seed=71)
    # its prompt: the chat template the GGUF carries, each medium's tokens
    expected = reference(tiny_gemma4_gguf.tiny, ["image", "audio"], QUESTION, picture)
    reply = _ask(client, png_bytes(picture), logprobs=True)
    assert_greedy_reply(reply, expected, LOGPROB_TOLERANCE)
    assert reply.usage.completion_tokens == NEW
    assert streamed_text(_ask(client, png_bytes(picture), stream=True)) == expected.text


def test_a_projector_that_does_not_fit_stops_serve(
    tiny_gemma4_gguf: TinyGemma4Gguf, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = tiny_gemma4_gguf.files
    narrow = rewrite(
        files["mmproj-f32"], tmp_path / "narrow.gguf", metadata={"clip.audio.projection_dim": 48}
    )
    args = ["serve", "-m", str(files["lm-f32"]), "--mmproj", str(narrow), "--port", "0"]
    assert main(args) == 2
    err = capsys.readouterr()
    assert "audio encoder gives 48-wide embeddings; the language model is 64 wide" in err.err
    assert "listening" not in err.out
