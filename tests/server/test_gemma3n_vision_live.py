"""`inferd serve` on the Gemma 3n image fixture (tests/models/data/gemma3n_vision: a tiny random
Gemma3nForConditionalGeneration with timm's MobileNet-v5 and its audio encoder; made in an
oracle venv by tests/models/gemma3n_vision_reference.py, since timm needs torchvision): the
startup says both encoders are served, /v1/models lists images and audio, and a PNG with text
sent as an ``image_url`` part through the strict OpenAI SDK reaches the model as transformers
took it. The oracle: the fixture's prompt (Gemma3nProcessor's ids: the image's 64 soft tokens
between ``<start_of_image>`` and ``<end_of_image>`` and blank lines) whose length ``usage``
counts, and transformers' greedy reply and each token's log-probability; streamed the same,
the image encoded once (the encoder cache); the Anthropic and Responses APIs count and answer
the same; an image and a WAV in one turn count as the processor writes them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from tests.media.corpus import Tone, wav_bytes
from tests.server.live import LiveServer, live_server
from tests.server.media_replies import (
    Greedy,
    assert_greedy_reply,
    encoder_calls,
    greedy_chat,
    image_on_anthropic_and_responses,
    streamed_text,
    wav_part,
)
from tests.server.test_vision_live import data_url

FIXTURE = Path(__file__).parents[1] / "models" / "data" / "gemma3n_vision"
QUESTION = "What is in the picture?"  # the fixture's prompt: the image, then this
LOGPROB_TOLERANCE = 1e-4  # float32 on both sides: only summation order differs


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("gemma3n-vision-serve") / "serve.log"
    # a prompt of 100 tokens prefills in chunks of 32: the image's rows span three of them
    args = ["-m", str(FIXTURE), "--dtype", "f32", "--max-num-batched-tokens", "32"]
    with live_server(args, log) as live:
        yield live


@pytest.fixture(scope="module")
def expected() -> Greedy:
    reference = torch.load(FIXTURE / "reference.pt")
    greedy = reference["greedy"]
    return Greedy(reference["input_ids"], greedy["text"], greedy["logprobs"])


def _image_url() -> str:
    return data_url((FIXTURE / "image.png").read_bytes())


def _ask(client: openai.OpenAI, expected: Greedy, **more: Any) -> Any:
    parts = [
        {"type": "image_url", "image_url": {"url": _image_url()}},
        {"type": "text", "text": QUESTION},
    ]
    return greedy_chat(client, parts, len(expected.logprobs), **more)


def test_the_startup_says_both_encoders_are_served(server: LiveServer) -> None:
    startup = server.log.read_text()
    line = "gemma3n serves image and audio: its image (MobileNet-v5) and audio (USM conformer)"
    assert line in startup
    card = httpx.get(server.api + "/models", timeout=10).json()["data"][0]
    assert card["modalities"]["input"] == ["text", "image", "audio"]


def test_an_image_url_reaches_the_model_as_transformers_takes_it(
    client: openai.OpenAI, server: LiveServer, expected: Greedy
) -> None:
    assert_greedy_reply(_ask(client, expected, logprobs=True), expected, LOGPROB_TOLERANCE)

    calls_before = encoder_calls(server)
    assert streamed_text(_ask(client, expected, stream=True)) == expected.text
    assert encoder_calls(server) == calls_before  # the image was cached


def test_anthropic_and_responses_count_and_answer_the_same(
    client: openai.OpenAI, server: LiveServer, expected: Greedy
) -> None:
    new = len(expected.logprobs)
    claude, responses, counted = image_on_anthropic_and_responses(
        server, client, _image_url(), QUESTION, new
    )
    for reply in (claude, responses):
        assert reply.prompt_tokens == len(expected.ids)
        assert reply.text == expected.text
    assert counted == len(expected.ids)


def test_an_image_and_a_wav_in_one_turn_count_as_the_processor_writes_them(
    client: openai.OpenAI,
) -> None:
    """The fixture's mixed prompt (the image, a clip, text): usage counts the processor's ids,
    the image's 64 tokens and the clip's fixed 188 whatever its samples."""
    mixed = torch.load(FIXTURE / "reference.pt")["mixed"]
    parts = [
        {"type": "image_url", "image_url": {"url": _image_url()}},
        wav_part(wav_bytes(Tone(16_000, 0.75, (440.0,)))),
        {"type": "text", "text": "And this?"},
    ]
    reply = greedy_chat(client, parts, 2)
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(mixed["input_ids"])
    assert reply.usage.completion_tokens == 2
