"""The served context and KV pool on a live server: a request without max_tokens gets the room
its prompt leaves (never a 400 for that alone), the startup lines say how the context was
decided, and a --max-seq-len past the model's positions is refused at startup."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from inferd.loading.gguf import GGUFFile
from tests.server.live import LiveServer, live_server

POOL = 64  # tokens: SmolLM2's 8,192-token context is lowered to this at startup
LOGPROBS_CAP = 100
STORY = "Write a long story about a lighthouse keeper, a storm and a ship."


@pytest.fixture(scope="module")
def tiny(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("sizing") / "serve.log"
    args = ["-m", str(smollm2_gguf), "--dtype", "f32", "--kv-cache-tokens", str(POOL)]
    with live_server([*args, "--max-logprobs-tokens", str(LOGPROBS_CAP)], log) as live:
        yield live


def _chat(server: LiveServer, **body: object) -> httpx.Response:
    messages = [{"role": "user", "content": STORY}]
    return httpx.post(
        server.api + "/chat/completions", json={"messages": messages, **body}, timeout=300
    )


def test_startup_says_the_context_was_lowered_in_one_engine_line(tiny: LiveServer) -> None:
    lines = tiny.log.read_text().splitlines()
    engine = [line for line in lines if line.startswith("inferd  engine ")]
    assert len(engine) == 1, lines
    assert f"context {POOL}, lowered from 8192" in engine[0]
    assert "set by --kv-cache-tokens" in engine[0]
    assert len([line for line in lines if line.startswith("inferd  limits ")]) == 1


def test_startup_states_the_memory_budget(tiny: LiveServer, smollm2_gguf: Path) -> None:
    """Weights as loaded (f32 here: every parameter dense, 4 bytes) against the file, plus the
    pool: SmolLM2 stores 30 layers x 3 KV heads x 64 x 2 (K, V) x 4 bytes per token."""
    line = next(ln for ln in tiny.log.read_text().splitlines() if ln.startswith("inferd  memory "))
    found = re.fullmatch(
        r"inferd  memory     budget ([\d,]+) MiB: weights ([\d,]+) MiB \(([\d.]+)x the file\) "
        r"\+ KV cache ([\d,]+) MiB, activations and runtime on top",
        line,
    )
    assert found, line
    budget, weights, ratio, pool = (float(g.replace(",", "")) for g in found.groups())
    params = sum(math.prod(i.shape) for i in GGUFFile(smollm2_gguf).tensor_infos())
    assert params * 4 / 2**20 <= weights <= params * 4 * 1.1 / 2**20
    assert ratio == pytest.approx(weights * 2**20 / smollm2_gguf.stat().st_size, abs=0.02)
    assert pool == round(POOL * 30 * 3 * 64 * 2 * 4 / 2**20)
    assert abs(budget - weights - pool) <= 1


def test_chat_without_max_tokens_runs_to_the_end_of_the_room(tiny: LiveServer) -> None:
    r = _chat(tiny, temperature=0)
    assert r.status_code == 200, r.text
    body = r.json()
    usage = body["usage"]
    assert body["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == POOL
    assert usage["completion_tokens"] >= 1


def test_completions_default_stays_within_the_room(tiny: LiveServer) -> None:
    ids = httpx.post(tiny.url + "/tokenize", json={"prompt": STORY * 8}).json()["tokens"]
    prompt = ids[: POOL - 5]  # room for 5: OpenAI's default of 16 would not fit
    assert len(prompt) == POOL - 5
    r = httpx.post(
        tiny.api + "/completions", json={"prompt": prompt, "temperature": 0}, timeout=300
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_a_prompt_that_fills_the_context_is_a_400_naming_it(tiny: LiveServer) -> None:
    r = _chat(tiny, messages=[{"role": "user", "content": STORY * 4}])
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages" and error["code"] == "context_length_exceeded"
    assert "leaves no room to generate" in error["message"]


def test_chat_logprobs_are_bounded_like_completions(tiny: LiveServer) -> None:
    # 2 choices x 20 tokens x (1 + 5) = 240 pairs, over the server's 100.
    r = _chat(tiny, logprobs=True, top_logprobs=5, n=2, max_tokens=20)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "top_logprobs" and "--max-logprobs-tokens" in error["message"]
    assert "240 (token, logprob) pairs" in error["message"]
    # Without max_tokens the default fits the bound: 100 // (2 x 6) = 8 tokens a choice.
    r = _chat(tiny, logprobs=True, top_logprobs=5, n=2, temperature=0)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert len(choice["logprobs"]["content"]) == 8
        assert choice["finish_reason"] == "length"


def test_max_seq_len_past_the_positions_is_refused_at_startup(smollm2_gguf: Path) -> None:
    serve = [sys.executable, "-m", "inferd", "serve", "--port", "9", "-m", str(smollm2_gguf)]
    result = subprocess.run(
        [*serve, "--dtype", "f32", "--max-seq-len", "8200"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert "--max-seq-len 8200 is beyond this model's positions" in result.stderr
    assert "give at most 8192" in result.stderr
