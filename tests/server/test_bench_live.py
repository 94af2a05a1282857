"""`inferd bench`'s HTTP harness against the real server, and its handling of absent peers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from inferd.bench.http import _consume, run_http
from inferd.bench.main import _run_peer, render
from inferd.bench.server_peers import PeerUnavailable, llama_server
from inferd.bench.stats import RequestTiming
from inferd.bench.workloads import Workload
from tests.server.live import LiveServer


def test_concurrent_streams_are_timed_and_counted(server: LiveServer) -> None:
    workload = Workload("tiny", requests=3, concurrency=2, max_tokens=6)
    summary = asyncio.run(run_http(server.api, "default", workload))
    assert summary.incomplete == 0
    assert summary.requests == 3
    # Usage from the server, and every request ran to max_tokens (no stop in 6 story tokens).
    assert summary.output_tokens == 18
    assert 0 < summary.ttft_p50 <= summary.ttft_p99 < summary.seconds
    assert summary.tokens_per_second == pytest.approx(18 / summary.seconds)
    table = render([summary], 1000.0)
    assert "| tiny | inferd | " in table and "peak RSS of `inferd serve`: 1000 MiB" in table


def test_a_stream_cut_before_done_is_incomplete() -> None:
    timing = RequestTiming(started=0.0)
    _consume('data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}', timing)
    assert not timing.completed and len(timing.token_times) == 1
    _consume("data: [DONE]", timing)  # no usage chunk: counted by its deltas
    assert timing.completed and timing.tokens is None


def test_a_missing_server_peer_is_skipped_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], smollm2_gguf: Path
) -> None:
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(PeerUnavailable, match="llama-server"):
        llama_server(smollm2_gguf, 1, 2, 16)
    assert _run_peer("llama-server", smollm2_gguf, 2, ["single"]) == []
    assert "skip llama-server: PeerUnavailable" in capsys.readouterr().err
