"""`inferd serve` on a tiny random Gemma3nForConditionalGeneration directory (its audio encoder
served, its image encoder not): a WAV with text, sent through the strict OpenAI SDK as an
``input_audio`` part, reaches the model as transformers' Gemma 3n takes it. The oracle:
Gemma3nProcessor's prompt for the chat template's text and the same samples (its 188 audio
tokens between blank lines), usage equal to that prompt's length, and the greedy reply and
each token's log-probability equal to Gemma3nForConditionalGeneration's generate, streamed and
not; the same clip twice is encoded once. The Anthropic and Responses APIs carry no audio part
here (Responses refuses ``input_audio``), so audio goes through chat alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.media.corpus import Tone, wav_bytes
from tests.server.live import LiveServer, live_server
from tests.server.media_replies import (
    Greedy,
    assert_greedy_reply,
    encoder_calls,
    greedy_chat,
    streamed_text,
    transformers_greedy,
    wav_part,
    wav_samples,
)

NEW = 8
LOGPROB_TOLERANCE = 1e-4  # float32 on both sides: only summation order differs (~1e-6)
QUESTION = "What does the sound say?"
TONE = Tone(16_000, 0.9, (440.0,))
Tiny = tuple[Path, Any, Any]


@pytest.fixture(scope="module")
def server(
    tiny_gemma3n_audio: Tiny, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("gemma3n-audio-serve") / "serve.log"
    # prompts of ~210 tokens prefill in chunks of 64: the clip's rows land in four of them
    args = ["-m", str(tiny_gemma3n_audio[0]), "--dtype", "f32", "--max-num-batched-tokens", "64"]
    with live_server(args, log) as live:
        yield live


def _reference(tiny: Tiny) -> Greedy:
    """transformers' greedy reply to one user turn: the clip (as soundfile reads the WAV),
    then the question."""
    _, hf, processor = tiny
    content = [{"type": "audio"}, {"type": "text", "text": QUESTION}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    inputs = processor(text=[text], audio=[wav_samples(wav_bytes(TONE))], return_tensors="pt")
    return transformers_greedy(hf, inputs, processor.tokenizer, NEW)


def _ask(client: openai.OpenAI, **more: Any) -> Any:
    parts = [wav_part(wav_bytes(TONE)), {"type": "text", "text": QUESTION}]
    return greedy_chat(client, parts, NEW, **more)


def test_the_startup_says_audio_is_served_and_images_are_not(server: LiveServer) -> None:
    startup = server.log.read_text()
    assert "gemma3n serves audio; its image encoder is not served" in startup
    card = httpx.get(server.api + "/models", timeout=10).json()["data"][0]
    assert card["modalities"]["input"] == ["text", "audio"]


def test_a_wav_reaches_the_model_as_transformers_takes_it(
    client: openai.OpenAI, tiny_gemma3n_audio: Tiny, server: LiveServer
) -> None:
    expected = _reference(tiny_gemma3n_audio)  # its prompt: 188 audio tokens, blank lines
    assert_greedy_reply(_ask(client, logprobs=True), expected, LOGPROB_TOLERANCE)

    calls_before = encoder_calls(server)
    assert streamed_text(_ask(client, stream=True)) == expected.text
    assert encoder_calls(server) == calls_before  # the clip was cached
