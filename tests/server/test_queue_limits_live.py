"""A full waiting queue answers 503 with Retry-After, and the server keeps serving."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.live import LiveServer, live_server

LONG = {
    "messages": [{"role": "user", "content": "Write a very long story."}],
    "max_tokens": 400,
    "ignore_eos": True,
    "stream": True,
}


@pytest.fixture(scope="module")
def small_server(
    smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("queue") / "serve.log"
    args = [
        "-m",
        str(smollm2_gguf),
        "--max-seqs",
        "1",
        "--max-waiting",
        "1",
        "--max-seq-len",
        "1024",
    ]
    with live_server(args, log) as server:
        yield server


def test_beyond_the_waiting_queue_requests_get_503_with_retry_after(
    small_server: LiveServer,
) -> None:
    url = small_server.api + "/chat/completions"
    with httpx.Client(timeout=60) as http:
        with (
            http.stream("POST", url, json=LONG) as first,
            http.stream("POST", url, json=LONG) as second,
        ):
            assert first.status_code == 200 and second.status_code == 200
            lines = first.iter_lines()  # kept referenced: a dropped iterator closes the stream
            next(lines)
            refused = http.post(url, json={**LONG, "stream": False})
            assert refused.status_code == 503
            assert refused.headers["retry-after"].isdigit()
            err = refused.json()["error"]
            assert "retry" in err["message"].lower() and err["type"] == "service_unavailable"
        # The server learns of the two closed streams asynchronously (milliseconds later), so a
        # request sent at once may still meet the full queue: it retries as told, briefly.
        deadline = time.monotonic() + 10
        while (
            ok := http.post(url, json={"messages": LONG["messages"], "max_tokens": 4})
        ).status_code == 503:
            assert time.monotonic() < deadline, ok.text
            time.sleep(0.1)
        assert ok.status_code == 200
