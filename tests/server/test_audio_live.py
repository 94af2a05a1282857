"""`inferd serve` on a Hugging Face Qwen2-Audio directory: it loads, /v1/models says it takes
audio (and not images), text chat runs on its decoder, and a WAV sent as an OpenAI
``input_audio`` part reaches the model as transformers hears it."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
import torch
from openai.types.chat import (
    ChatCompletionContentPartInputAudioParam,
    ChatCompletionContentPartTextParam,
)

from inferd.media.audio import decode_audio
from tests.models.test_whisper_features import tone
from tests.server.live import LiveServer, live_server

NEW = 6


@pytest.fixture(scope="module")
def audio_server(
    tiny_qwen2_audio: tuple[Path, Any, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("audio-serve") / "serve.log"
    args = ["-m", str(tiny_qwen2_audio[0]), "--dtype", "f32", "--encoder-cache-mb", "16"]
    with live_server(args, log) as live:
        yield live


def test_models_lists_audio_input(audio_server: LiveServer) -> None:
    cards = httpx.get(audio_server.api + "/models", timeout=10).json()["data"]
    assert len(cards) == 1
    assert cards[0]["modalities"] == {"input": ["text", "audio"], "output": ["text"]}


def test_text_chat_runs_on_the_audio_model(audio_server: LiveServer) -> None:
    model = httpx.get(audio_server.api + "/models", timeout=10).json()["data"][0]["id"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "The quick brown fox"}],
        "max_tokens": 5,
        "temperature": 0,
    }
    reply = httpx.post(audio_server.api + "/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 5


def _wav(samples: np.ndarray, rate: int) -> bytes:
    out = io.BytesIO()
    sf.write(out, samples, rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def _reference(tiny: tuple[Path, Any, Any], wav: bytes, question: str) -> tuple[int, str]:
    """transformers' prompt length and greedy reply for the clip as inferd decodes it."""
    _, hf, processor = tiny
    clip = decode_audio(wav).resampled(16000).mono()
    messages = [
        {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": question}]}
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], audio=[clip], sampling_rate=16000, return_tensors="pt")
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :].tolist()
    return inputs["input_ids"].shape[1], processor.tokenizer.decode(new, skip_special_tokens=True)


@pytest.mark.parametrize("rate", [16000, 22050], ids=["16kHz", "22kHz-resampled"])
def test_input_audio_reaches_the_model_as_transformers_hears_it(
    audio_server: LiveServer, tiny_qwen2_audio: tuple[Path, Any, Any], rate: int
) -> None:
    wav = _wav(tone(1.1, 330.0, rate), rate)
    prompt_tokens, text = _reference(tiny_qwen2_audio, wav, "What is it?")
    audio: ChatCompletionContentPartInputAudioParam = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"},
    }
    question: ChatCompletionContentPartTextParam = {"type": "text", "text": "What is it?"}
    # Closed on the way out: a client left to the garbage collector closes its socket in
    # whichever test runs then, which fails that test on the ResourceWarning.
    with openai.OpenAI(base_url=audio_server.api, api_key="none", max_retries=0) as client:
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": [audio, question]}],
            max_tokens=NEW,
            temperature=0,
        )
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == prompt_tokens  # the clip's rows counted
    assert reply.choices[0].message.content == text


def test_a_different_clip_changes_the_prompt(audio_server: LiveServer) -> None:
    """A longer clip takes more audio rows; an image is refused by this model by name."""
    model = httpx.get(audio_server.api + "/models", timeout=10).json()["data"][0]["id"]

    def prompt_tokens(seconds: float) -> int:
        wav = base64.b64encode(_wav(tone(seconds, 440.0, 16000), 16000)).decode()
        part = {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}
        body = {"model": model, "messages": [{"role": "user", "content": [part]}], "max_tokens": 1}
        reply = httpx.post(audio_server.api + "/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        return int(reply.json()["usage"]["prompt_tokens"])

    assert prompt_tokens(2.0) > prompt_tokens(0.5)
    png = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n").decode()
    image = {"type": "image_url", "image_url": {"url": png}}
    body = {"model": model, "messages": [{"role": "user", "content": [image]}], "max_tokens": 1}
    refused = httpx.post(audio_server.api + "/chat/completions", json=body, timeout=60)
    assert refused.status_code == 400
    assert "messages.0.content.0" in refused.json()["error"]["message"]
