"""``--prefix-cache-n``, ``--max-decode-steps-before-prefill`` and ``--no-kv-cache`` through the
real CLI: two float32 servers, one keeping a single cached prefix and spacing prompt chunks
between decodes (a 32-token step budget, so a long prompt is chunked), one recomputing every
token. The same concurrent greedy requests get the same replies from both; the prefix count
shows in what hits; contradictory flags are refused before any model loads."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.live import LiveServer, live_server

CHATS = ["Name three rivers in Europe.", "Write one sentence about a lighthouse."]
LONG = "The lighthouse keeper counted the ships that passed the headland at dusk. " * 8


@pytest.fixture(scope="module")
def counted(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("cache-flags") / "counted.log"
    args = ["-m", str(smollm2_gguf), "--dtype", "f32", "--prefix-cache-n", "1"]
    args += ["--max-decode-steps-before-prefill", "2", "--max-num-batched-tokens", "32"]
    with live_server(args, log) as live:
        yield live


@pytest.fixture(scope="module")
def bare(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("cache-flags") / "bare.log"
    with live_server(["-m", str(smollm2_gguf), "--dtype", "f32", "--no-kv-cache"], log) as live:
        yield live


def _engine_line(server: LiveServer) -> str:
    lines = server.log.read_text().splitlines()
    return next(ln for ln in lines if ln.startswith("inferd  engine "))


def test_the_startup_lines_state_the_flags(counted: LiveServer, bare: LiveServer) -> None:
    line = _engine_line(counted)
    assert "prefix cache keeps 1 entries" in line and "at most 2 decode steps" in line, line
    line = _engine_line(bare)
    assert "no KV cache (--no-kv-cache)" in line and "speculative decoding off" in line, line


async def _replies(server: LiveServer) -> list[str]:
    """Both chats and the long completion at once, greedy."""
    async with httpx.AsyncClient(base_url=server.api, timeout=600) as client:

        async def ask(path: str, body: dict[str, Any]) -> str:
            reply = (await client.post(path, json={**body, "temperature": 0})).json()
            choice = reply["choices"][0]
            return str(choice["message"]["content"] if "message" in choice else choice["text"])

        chats = [{"messages": [{"role": "user", "content": c}], "max_tokens": 12} for c in CHATS]
        asks = [ask("/chat/completions", chat) for chat in chats]
        asks.append(ask("/completions", {"prompt": LONG, "max_tokens": 8}))
        return list(await asyncio.gather(*asks))


def test_recomputing_every_token_gives_the_cached_replies(
    counted: LiveServer, bare: LiveServer
) -> None:
    """The long prompt is prefilled in chunks spaced between the chats' decodes on one server,
    and every token recomputes its whole sequence on the other: the same greedy replies."""
    cached = asyncio.run(_replies(counted))
    assert all(cached) and asyncio.run(_replies(bare)) == cached
    assert bare.metric("inferd_prefix_cache_queries_total") == 0
    assert bare.metric("inferd_speculative_draft_tokens_total") == 0


def test_one_kept_prefix_forgets_the_one_used_before(counted: LiveServer) -> None:
    """With one entry kept, a prompt sent again after another is found only if it was the
    last one used (without the count both would be found)."""

    def hits_of(prompt: str) -> float:
        before = counted.metric("inferd_prefix_cache_hits_total")
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
        assert httpx.post(counted.api + "/completions", json=body, timeout=300).status_code == 200
        return counted.metric("inferd_prefix_cache_hits_total") - before

    first, second = "Rivers of Europe and their cities. " * 6, "Mountains, glaciers, valleys. " * 6
    hits_of(first)
    hits_of(second)
    assert hits_of(second) > 0  # the one entry kept
    assert hits_of(first) == 0  # forgotten when the second one's chain came in
    assert counted.metric("inferd_prefix_cache_entries") == 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prefix-caching", "off", "--prefix-cache-n", "4"], "prefix caching is off"),
        (["--prefix-caching", "on", "--no-kv-cache"], "contradicts --no-kv-cache"),
    ],
)
def test_contradictory_flags_are_refused_before_loading(flags: list[str], message: str) -> None:
    argv = [sys.executable, "-m", "inferd", "serve", "-m", "/nonexistent.gguf", *flags]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and message in out.stderr, out.stderr
