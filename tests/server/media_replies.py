"""What the live multimodal tests ask a served model beside chat: one image and a question
through the strict Anthropic and Responses APIs (greedy, to the token cap), and how many media
the encoders have run so far; and what transformers' generate replied, token by token."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import openai
import torch

from tests.server.live import LiveServer


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


def generated_reply(out: Any, prompt_tokens: int) -> tuple[list[int], list[float]]:
    """The tokens of transformers' greedy reply (``generate`` with ``output_logits`` and
    ``return_dict_in_generate``) and each one's log-probability."""
    tokens: list[int] = out.sequences[0, prompt_tokens:].tolist()
    logprobs = [
        float(torch.log_softmax(step[0].float(), -1)[token])
        for step, token in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logprobs
