"""`inferd serve` on a Hugging Face Idefics3 (SmolVLM) directory: it loads, /v1/models says it
takes images, and text chat runs on its decoder."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.live import LiveServer, live_server


@pytest.fixture(scope="module")
def vision_server(
    tiny_idefics3: tuple[Path, Any, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("vision-serve") / "serve.log"
    args = ["-m", str(tiny_idefics3[0]), "--dtype", "f32", "--encoder-cache-mb", "16"]
    with live_server(args, log) as live:
        yield live


def test_models_lists_image_input(vision_server: LiveServer) -> None:
    cards = httpx.get(vision_server.api + "/models", timeout=10).json()["data"]
    assert len(cards) == 1
    assert cards[0]["modalities"]["input"] == ["text", "image"]
    assert cards[0]["modalities"]["output"] == ["text"]


def test_text_chat_runs_on_the_vision_model(
    vision_server: LiveServer, tiny_idefics3: tuple[Path, Any, Any]
) -> None:
    body = {
        "model": httpx.get(vision_server.api + "/models", timeout=10).json()["data"][0]["id"],
        "messages": [{"role": "user", "content": "The quick brown fox"}],
        "max_tokens": 5,
        "temperature": 0,
    }
    reply = httpx.post(vision_server.api + "/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    assert usage["completion_tokens"] == 5
    processor = tiny_idefics3[2]  # the text reached the template (it iterates content parts)
    parts = [{"role": "user", "content": [{"type": "text", "text": "The quick brown fox"}]}]
    text = processor.apply_chat_template(parts, add_generation_prompt=True)
    assert usage["prompt_tokens"] == len(processor.tokenizer(text)["input_ids"])
