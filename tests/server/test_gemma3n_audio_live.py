"""`inferd serve` on a tiny random Gemma3nForConditionalGeneration directory (its audio encoder
served, its image encoder not): a WAV with text, sent through the strict OpenAI SDK as an
``input_audio`` part, reaches the model as transformers' Gemma 3n takes it. The oracle:
Gemma3nProcessor's prompt for the chat template's text and the same samples (its 188 audio
tokens between blank lines), usage equal to that prompt's length, and the greedy reply and
each token's log-probability equal to Gemma3nForConditionalGeneration's generate, streamed and
not; the same clip twice is encoded once. The Anthropic and Responses APIs carry no audio part
here (Responses refuses ``input_audio``), so audio goes through chat alone."""

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
import soundfile
import torch

from tests.media.corpus import Tone, wav_bytes
from tests.server.live import LiveServer, live_server
from tests.server.media_replies import encoder_calls

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


def _reference(tiny: Tiny) -> tuple[list[int], str, list[float]]:
    """transformers' prompt ids, greedy reply and each reply token's log-probability for one
    user turn: the clip (as soundfile reads the WAV), then the question."""
    _, hf, processor = tiny
    samples, rate = soundfile.read(io.BytesIO(wav_bytes(TONE)), dtype="float32")
    assert rate == 16_000
    content = [{"type": "audio"}, {"type": "text", "text": QUESTION}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    inputs = processor(text=[text], audio=[np.asarray(samples)], return_tensors="pt")
    with torch.inference_mode():
        out = hf.generate(
            **inputs,
            max_new_tokens=NEW,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    ids = inputs["input_ids"][0].tolist()
    tokens = out.sequences[0, len(ids) :].tolist()
    logprobs = [
        float(torch.log_softmax(step[0].float(), -1)[token])
        for step, token in zip(out.logits, tokens, strict=True)
    ]
    return ids, processor.tokenizer.decode(tokens, skip_special_tokens=True), logprobs


def _ask(client: openai.OpenAI, **more: Any) -> Any:
    audio = base64.b64encode(wav_bytes(TONE)).decode()
    parts: Any = [
        {"type": "input_audio", "input_audio": {"data": audio, "format": "wav"}},
        {"type": "text", "text": QUESTION},
    ]
    return client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": parts}],
        max_tokens=NEW,
        temperature=0,
        extra_body={"ignore_eos": True},
        **more,
    )


def test_the_startup_says_audio_is_served_and_images_are_not(server: LiveServer) -> None:
    startup = server.log.read_text()
    assert "gemma3n serves audio; its image encoder is not served" in startup
    card = httpx.get(server.api + "/models", timeout=10).json()["data"][0]
    assert card["modalities"]["input"] == ["text", "audio"]


def test_a_wav_reaches_the_model_as_transformers_takes_it(
    client: openai.OpenAI, tiny_gemma3n_audio: Tiny, server: LiveServer
) -> None:
    ids, text, logprobs = _reference(tiny_gemma3n_audio)
    reply = _ask(client, logprobs=True)
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(ids)  # the 188 audio tokens and their blank lines
    assert reply.choices[0].message.content == text
    # The random model's greedy text says little; each token's log-probability moves with
    # any audio row out of place.
    served = [t.logprob for t in reply.choices[0].logprobs.content]
    assert served == pytest.approx(logprobs, abs=LOGPROB_TOLERANCE)

    calls_before = encoder_calls(server)
    chunks = list(_ask(client, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert encoder_calls(server) == calls_before  # the clip was cached
