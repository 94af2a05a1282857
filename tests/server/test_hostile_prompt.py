"""Huge prompts (issue 10, item 5): a prompt whose characters cannot fit the context is refused
before it is tokenized, and the server gives the memory such requests took back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.hostile import ANTHROPIC, assert_healthy, hostile_server, refused
from tests.server.live import LiveServer

HUGE = "All work and no play makes Jack a dull boy. " * 160_000  # 7 MB
REQUESTS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": HUGE}], "max_tokens": 4}),
    ("/v1/completions", {"prompt": HUGE, "max_tokens": 4}),
    ("/v1/completions", {"prompt": ["Hi", HUGE], "max_tokens": 4}),
    (
        "/v1/messages",
        {"model": "default", "messages": [{"role": "user", "content": HUGE}], "max_tokens": 4},
    ),
]


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("hostile-prompt") / "serve.log"
    with hostile_server(smollm2_gguf, log) as live:
        yield live


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize(
    ("path", "body"), REQUESTS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(REQUESTS)]
)
def test_a_prompt_that_cannot_fit_is_refused_untokenized(
    server: LiveServer, path: str, body: dict[str, object]
) -> None:
    anthropic = path == "/v1/messages"
    r = httpx.post(
        server.url + path, json=body, headers=ANTHROPIC if anthropic else {}, timeout=120
    )
    error = refused(r, 400, anthropic=anthropic, says="characters")
    assert "this model's context is 2048 tokens" in error["message"], error
    if not anthropic:
        assert error["code"] == "context_length_exceeded"
        assert error["param"] in ("messages", "prompt", "prompt.1")
    assert_healthy(server)


def test_memory_is_given_back_after_huge_prompts(server: LiveServer) -> None:
    small = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert httpx.post(server.api + "/chat/completions", json=small, timeout=120).status_code == 200
    start = _rss_bytes(server.process.pid)
    for i in range(20):
        path, body = REQUESTS[i % len(REQUESTS)]
        r = httpx.post(server.url + path, json=body, headers=ANTHROPIC, timeout=120)
        assert r.status_code == 400, r.text[:300]
    grown = _rss_bytes(server.process.pid) - start
    assert grown < 100 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB"
    assert_healthy(server)
