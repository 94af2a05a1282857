"""What the live multimodal tests ask a served model and hold its replies to: a user turn of
media and text through chat completions, greedy to the token cap, against transformers' greedy
reply (its prompt's length, text and each token's log-probability); one image and a question
through the strict Anthropic and Responses APIs; and how many media the encoders have run so
far."""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import numpy as np
import numpy.typing as npt
import openai
import pytest
import soundfile
import torch

from tests.server.live import LiveServer


@dataclass(frozen=True)
class Greedy:
    """transformers' greedy reply: the prompt's ids, the reply's text and each reply token's
    log-probability."""

    ids: list[int]
    text: str
    logprobs: list[float]


def transformers_greedy(hf: Any, inputs: dict[str, Any], tokenizer: Any, new: int) -> Greedy:
    """``hf``'s greedy reply of ``new`` tokens to ``inputs`` (one prompt)."""
    ids = inputs["input_ids"][0].tolist()
    with torch.inference_mode():
        out = hf.generate(
            **inputs,
            max_new_tokens=new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(ids) :].tolist()
    logprobs = [
        float(torch.log_softmax(step[0].float(), -1)[token])
        for step, token in zip(out.logits, tokens, strict=True)
    ]
    return Greedy(ids, tokenizer.decode(tokens, skip_special_tokens=True), logprobs)


def greedy_chat(
    client: openai.OpenAI, parts: list[dict[str, Any]], max_tokens: int, **more: Any
) -> Any:
    """One user turn of content ``parts`` through chat completions, greedy to exactly
    ``max_tokens`` (``more``: the request's other fields, e.g. ``model``, ``logprobs``,
    ``stream``)."""
    request: dict[str, Any] = {"model": "default", **more}
    return client.chat.completions.create(
        messages=[{"role": "user", "content": parts}],
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
        **request,
    )


def assert_greedy_reply(reply: Any, expected: Greedy, tolerance: float) -> None:
    """A chat reply (asked with ``logprobs``) is transformers' greedy one: usage counts its
    prompt, the text is its text, and each token's log-probability is within ``tolerance`` of
    its own (the random model's greedy text says little; each token's log-probability moves
    with any media row or attention span out of place)."""
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(expected.ids)
    assert reply.choices[0].message.content == expected.text
    served = [t.logprob for t in reply.choices[0].logprobs.content]
    assert served == pytest.approx(expected.logprobs, abs=tolerance)


def streamed_text(chunks: Iterable[Any]) -> str:
    """The text of a streamed chat reply's chunks."""
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def wav_part(wav: bytes) -> dict[str, Any]:
    """A chat content part holding a WAV."""
    data = base64.b64encode(wav).decode()
    return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}


def wav_samples(wav: bytes) -> npt.NDArray[np.float32]:
    """A 16 kHz WAV's samples as soundfile reads them (what transformers' users hand it)."""
    samples, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    assert rate == 16_000
    return np.asarray(samples)


@dataclass(frozen=True)
class Reply:
    prompt_tokens: int
    text: str


def image_on_anthropic_and_responses(
    server: LiveServer, client: openai.OpenAI, url: str, question: str, max_tokens: int
) -> tuple[Reply, Reply, int]:
    """The image (a data: URL) then the question, greedy: the Anthropic reply, the Responses
    reply, and Anthropic's count_tokens for the same message."""
    source = {"type": "base64", "media_type": "image/png", "data": url.split(",", 1)[1]}
    content: Any = [{"type": "image", "source": source}, {"type": "text", "text": question}]
    with anthropic.Anthropic(
        base_url=server.url, api_key="unused", max_retries=0, _strict_response_validation=True
    ) as claude:
        counted = claude.messages.count_tokens(
            model="default", messages=[{"role": "user", "content": content}]
        )
        message = claude.messages.create(
            model="default",
            max_tokens=max_tokens,
            messages=[{"role": "user", "content": content}],
            extra_body={"temperature": 0, "ignore_eos": True},
        )
    response = client.responses.create(
        model="default",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": url, "detail": "auto"},
                    {"type": "input_text", "text": question},
                ],
            }
        ],
        max_output_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert response.usage is not None
    said = "".join(b.text for b in message.content if b.type == "text")
    return (
        Reply(message.usage.input_tokens, said),
        Reply(response.usage.input_tokens, response.output_text),
        counted.input_tokens,
    )


def encoder_calls(server: LiveServer) -> float:
    """Media encoded so far (those the encoder cache did not hold)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    found = re.search(r"^inferd_images_encoded_total(?:\{[^}]*\})? ([\d.e+]+)$", text, re.M)
    assert found is not None, "no encoder counter in /metrics"
    return float(found.group(1))
