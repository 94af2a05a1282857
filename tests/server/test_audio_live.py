"""`inferd serve` on a Hugging Face Qwen2-Audio directory: it loads, /v1/models says it takes
audio (and not images), and text chat runs on its decoder."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.live import LiveServer, live_server


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
