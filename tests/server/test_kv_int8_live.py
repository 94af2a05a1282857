"""A live server with ``--kv-cache-dtype int8``: it says the KV dtype and the pool's tokens at
startup, in /metrics and in /v1/system/info, holds ~1.9x the tokens bf16 would in the same
``--kv-cache-mb``, and answers chat sensibly (a factual answer, and a passage copied word for
word, which needs attention to read its keys back accurately)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.live import LiveServer, live_server

KV_MB = 64
# SmolLM2-135M's KV bytes per token in bf16: K and V, 30 layers, 3 KV heads of 64 values.
BF16_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2
PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs at dusk, lit the great lamp and wrote in "
    "his log the wind, the rain and the names of the ships that passed."
)


@pytest.fixture(scope="module")
def int8_server(
    smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("serve-int8") / "serve.log"
    args = ["-m", str(smollm2_gguf), "--kv-cache-dtype", "int8", "--kv-cache-mb", str(KV_MB)]
    with live_server(args, log) as live:
        yield live


def _chat(server: LiveServer, content: str, max_tokens: int) -> str:
    with openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0) as client:
        reply = client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": content}],
            temperature=0,
            max_tokens=max_tokens,
        )
    return reply.choices[0].message.content or ""


def test_the_int8_pool_is_said_and_nearly_twice_bf16s(int8_server: LiveServer) -> None:
    info = httpx.get(int8_server.api + "/system/info", timeout=10).json()
    model = info["server"]["models"][0]
    tokens = model["kv_cache_tokens"]
    assert model["kv_cache_dtype"] == "int8"
    metrics = httpx.get(int8_server.url + "/metrics", timeout=10).text
    assert re.search(rf'inferd_kv_cache_capacity_tokens\{{.*dtype="int8".*\}} {tokens}\.0', metrics)
    assert f"KV cache {tokens} tokens of int8" in int8_server.log.read_text()  # startup line
    bf16_tokens = KV_MB * 2**20 // BF16_BYTES_PER_TOKEN // 16 * 16
    assert tokens >= 1.9 * bf16_tokens, (tokens, bf16_tokens)


def test_int8_cache_answers_sensibly(int8_server: LiveServer) -> None:
    answer = _chat(int8_server, "What is the capital of France? Answer in one sentence.", 16)
    assert "Paris" in answer, answer
    copied = _chat(int8_server, f"Repeat this text word for word:\n\n{PASSAGE}", 48)
    # The copy: the passage's first dozen words in order (greedy, so no luck involved).
    assert " ".join(PASSAGE.split()[:12]) in " ".join(copied.split()), copied
