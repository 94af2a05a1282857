"""`inferd serve` on the tiny Gemma 3 vision directory: /v1/models says it takes images, and
images sent over the OpenAI (image_url) and Anthropic (image block) APIs, through the official
SDKs in strict mode, reach the model as transformers sees them: the same prompt tokens and the
same greedy reply as transformers' processor and generate."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import torch
from PIL import Image

from tests.models.test_idefics3_processor import generated
from tests.server.live import LiveServer, live_server
from tests.server.test_vision_live import data_url, image_turn, png_bytes

NEW = 8
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def server(
    tiny_gemma3v: tuple[Path, Any, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("gemma3v-serve") / "serve.log"
    # A budget of 8 tokens a step: the image's 16 soft tokens still go in one chunk.
    args = ["-m", str(tiny_gemma3v[0]), "--dtype", "f32", "--max-num-batched-tokens", "8"]
    with live_server(args, log) as live:
        yield live


@pytest.fixture(scope="module")
def model_id(server: LiveServer) -> str:
    return str(httpx.get(server.api + "/models", timeout=10).json()["data"][0]["id"])


def reference(tiny_gemma3v: tuple[Path, Any, Any], image: Image.Image) -> tuple[int, str]:
    """transformers' prompt length and greedy reply for one image and QUESTION after it."""
    _, hf, processor = tiny_gemma3v
    parts = [{"type": "image"}, {"type": "text", "text": QUESTION}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True
    )
    inputs = processor(text=[text], images=[[image]], return_tensors="pt")
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert len(new) == NEW
    return inputs["input_ids"].shape[1], processor.tokenizer.decode(new, skip_special_tokens=True)


def test_models_lists_image_input(server: LiveServer) -> None:
    cards = httpx.get(server.api + "/models", timeout=10).json()["data"]
    assert cards[0]["modalities"]["input"] == ["text", "image"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_openai_image_url_matches_transformers(
    server: LiveServer, model_id: str, tiny_gemma3v: tuple[Path, Any, Any], stream: bool
) -> None:
    image = generated(70, 50, seed=1)
    prompt_tokens, text = reference(tiny_gemma3v, image)
    with openai.OpenAI(
        base_url=server.api, api_key="unused", max_retries=0, _strict_response_validation=True
    ) as oai:
        ask: dict[str, Any] = {
            "model": model_id,
            "messages": image_turn(data_url(png_bytes(image)), QUESTION),
            "max_tokens": NEW,
            "temperature": 0,
        }
        if stream:
            chunks = list(
                oai.chat.completions.create(
                    **ask, stream=True, stream_options={"include_usage": True}
                )
            )
            answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        else:
            reply = oai.chat.completions.create(**ask)
            answer, usage = reply.choices[0].message.content or "", reply.usage
    assert usage is not None
    assert usage.prompt_tokens == prompt_tokens  # the image's soft tokens counted
    assert usage.completion_tokens == NEW
    assert answer == text


def test_anthropic_image_block_matches_transformers(
    server: LiveServer, model_id: str, tiny_gemma3v: tuple[Path, Any, Any]
) -> None:
    image = generated(30, 90, seed=7)
    prompt_tokens, text = reference(tiny_gemma3v, image)
    source = {
        "type": "base64",
        "media_type": "image/png",
        "data": base64.b64encode(png_bytes(image)).decode(),
    }
    messages: Any = [
        {
            "role": "user",
            "content": [{"type": "image", "source": source}, {"type": "text", "text": QUESTION}],
        }
    ]
    with anthropic.Anthropic(
        base_url=server.url, api_key="unused", max_retries=0, _strict_response_validation=True
    ) as claude:
        msg = claude.messages.create(
            model=model_id, max_tokens=NEW, messages=messages, extra_body={"temperature": 0}
        )
    assert msg.usage.input_tokens == prompt_tokens
    assert "".join(b.text for b in msg.content if b.type == "text") == text
