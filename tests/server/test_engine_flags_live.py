"""Engine flags from mistral.rs's surface, through the real CLI at default settings:
``--disable-eos-stop`` (the model's end tokens stop no reply) and ``--max-prefill-chunk-tokens``
(mistral.rs's name for the step's token budget, which bounds each prefill chunk)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.live import LiveServer, live_server

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("engine-flags") / "serve.log"
    args = ["-m", str(smollm2_gguf), "--disable-eos-stop", "--max-prefill-chunk-tokens", "64"]
    with live_server(args, log) as live:
        yield live


def test_the_startup_line_states_both(server: LiveServer) -> None:
    lines = server.log.read_text().splitlines()
    line = next(ln for ln in lines if ln.startswith("inferd  engine "))
    assert "batch tokens 64," in line, line
    assert "eos stops nothing (--disable-eos-stop)" in line, line


def test_a_reply_runs_past_the_end_of_turn_to_max_tokens(server: LiveServer) -> None:
    """Greedy "Say hi." ends its turn within a few tokens: here the end-of-turn token shows up
    among the reply's tokens and generation goes on to max_tokens."""
    body = {
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": True,
    }
    reply = httpx.post(server.api + "/chat/completions", json=body, timeout=120).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "length", reply
    assert reply["usage"]["completion_tokens"] == MAX_TOKENS
    tokens = [entry["token"] for entry in choice["logprobs"]["content"]]
    assert "<|im_end|>" in tokens, tokens


def test_a_long_prompt_is_prefilled_in_chunks_and_answered(server: LiveServer) -> None:
    """A prompt of several 64-token chunks prefills and answers (the same greedy reply as a
    second time, from the prefix cache)."""
    text = "The lighthouse keeper counted the ships. " * 40
    body = {"prompt": text, "max_tokens": 8, "temperature": 0}
    first = httpx.post(server.api + "/completions", json=body, timeout=120).json()
    again = httpx.post(server.api + "/completions", json=body, timeout=120).json()
    assert first["usage"]["prompt_tokens"] > 3 * 64
    assert first["choices"][0]["text"] == again["choices"][0]["text"]
    assert first["usage"]["completion_tokens"] == 8
