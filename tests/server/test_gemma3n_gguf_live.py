"""`inferd serve -m lm.gguf`: the tiny random Gemma 3n as llama.cpp's own converter writes it
(tests/models/tiny_gemma3n.py, tests/models/llama_cpp_convert.py), a text model, through the
strict OpenAI SDK. /v1/models lists text input alone; a question gets transformers' greedy reply
on the checkpoint the file came from (the oracle of the directory's own path): usage equal to
the prompt the chat template (which the GGUF carries) renders, and each reply token's
log-probability, streamed and not; an image or a clip is refused with a 400 in OpenAI's
envelope, naming what the model takes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from PIL import Image

from tests.media.corpus import Tone, wav_bytes
from tests.models.test_gemma3n_gguf import QUESTION
from tests.models.tiny_gemma3n import TinyGemma3nGguf
from tests.server.live import LiveServer, live_server
from tests.server.media_replies import (
    Greedy,
    assert_greedy_reply,
    greedy_chat,
    streamed_text,
    transformers_greedy,
    wav_part,
)
from tests.server.test_gemma4_live import LOGPROB_TOLERANCE
from tests.server.test_vision_live import data_url, png_bytes

NEW = 6


@pytest.fixture(scope="module")
def server(
    tiny_gemma3n_gguf: TinyGemma3nGguf, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("gemma3n-gguf-serve") / "serve.log"
    args = ["-m", str(tiny_gemma3n_gguf.files["lm-q8_0"]), "--dtype", "f32"]
    with live_server(args, log) as live:
        yield live


def _reference(tiny: TinyGemma3nGguf) -> Greedy:
    """transformers' greedy reply to the question, its prompt written by the directory's
    tokenizer's chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny.directory))
    content = [{"type": "text", "text": QUESTION}]
    inputs = tok.apply_chat_template(
        [{"role": "user", "content": content}],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )
    return transformers_greedy(tiny.hf, dict(inputs), tok, NEW)


def test_models_lists_text_input_alone(server: LiveServer) -> None:
    card = httpx.get(server.api + "/models", timeout=10).json()["data"][0]
    assert card["id"] == "lm-q8_0"
    assert card["modalities"]["input"] == ["text"]


def test_a_question_gets_the_transformers_reply(
    client: openai.OpenAI, tiny_gemma3n_gguf: TinyGemma3nGguf
) -> None:
    expected = _reference(tiny_gemma3n_gguf)
    parts = [{"type": "text", "text": QUESTION}]
    reply = greedy_chat(client, parts, NEW, logprobs=True)
    assert_greedy_reply(reply, expected, LOGPROB_TOLERANCE)
    assert reply.usage.completion_tokens == NEW
    assert streamed_text(greedy_chat(client, parts, NEW, stream=True)) == expected.text


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": data_url(png_bytes(Image.new("RGB", (4, 4))))}},
        wav_part(wav_bytes(Tone(16_000, 0.3, (440.0,)))),
    ],
    ids=["image", "audio"],
)
def test_media_are_refused(client: openai.OpenAI, part: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        greedy_chat(client, [part, {"type": "text", "text": QUESTION}], NEW)
    assert err.value.status_code == 400
    body = err.value.body
    assert isinstance(body, dict) and "text" in body["message"], body
