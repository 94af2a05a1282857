"""What every hostile-request test checks: the refusal's status and envelope, the request id,
and that the server is still healthy with no KV blocks held afterwards."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.server.live import LiveServer, live_server

# The routes that take a JSON body, each with the envelope its errors come in.
POST_ROUTES: tuple[tuple[str, bool], ...] = (
    ("/v1/chat/completions", False),
    ("/v1/completions", False),
    ("/v1/embeddings", False),
    ("/v1/responses", False),
    ("/v1/messages", True),
    ("/v1/messages/count_tokens", True),
    ("/v1/tokenize", False),
    ("/v1/detokenize", False),
    ("/v1/models/unload", False),
    ("/v1/models/reload", False),
    ("/v1/models/status", False),
    ("/v1/re_isq", False),
    ("/v1/calibration/start", False),
    ("/v1/calibration/apply", False),
    ("/v1/load_lora_adapter", False),
    ("/v1/unload_lora_adapter", False),
    ("/v1/agent/approvals/unknown", False),
)

ANTHROPIC = {"anthropic-version": "2023-06-01"}


@contextmanager
def hostile_server(model: Path, log: Path, extra: Sequence[str] = ()) -> Iterator[LiveServer]:
    """The default model as tests/server/conftest.py serves it, one per hostile module."""
    args = ["-m", str(model), "--dtype", "f32", "--max-seqs", "8", "--max-seq-len", "2048"]
    args += ["--responses-store", ":memory:"]  # stored responses stay in the process
    with live_server([*args, *extra], log) as live:
        yield live


def envelope(response: httpx.Response, *, anthropic: bool) -> dict[str, Any]:
    """The error object of a response in the caller's envelope (asserted), with its request id."""
    assert response.headers.get("x-request-id"), response.headers
    body = response.json()
    if anthropic:
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    else:
        assert set(body) == {"error"} and set(body["error"]) == {
            "message",
            "type",
            "param",
            "code",
        }, body
    error: dict[str, Any] = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    return error


def refused(
    response: httpx.Response, status: int, *, anthropic: bool = False, says: str = ""
) -> dict[str, Any]:
    """Assert ``status`` in the right envelope, its message containing ``says``."""
    assert response.status_code == status, response.text[:500]
    error = envelope(response, anthropic=anthropic)
    assert says in error["message"], error
    return error


def assert_healthy(server: LiveServer, timeout: float = 30.0) -> None:
    """/health answers and every KV block is back in the pool (freed at the engine's next
    step, so it may take a moment after an aborted request)."""
    assert server.process.poll() is None, "the server exited"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    deadline = time.monotonic() + timeout
    while (used := server.metric("inferd_kv_blocks_used")) != 0:
        assert time.monotonic() < deadline, f"{used:g} KV blocks still held"
        time.sleep(0.2)
