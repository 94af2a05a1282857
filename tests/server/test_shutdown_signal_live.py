"""SIGTERM on a real `inferd serve` with requests in flight: drain, then cut cleanly, exit 0.

At the signal five requests are running: a /v1/tokenize whose body is still arriving (it
finishes during the drain once the rest is sent), and four that generate 1800 tokens (OpenAI
chat stream, Anthropic stream, Responses stream, non-stream), far more than the 4 s drain allows
on any CPU. While draining, new requests and /ready get 503 with Retry-After and /health still
answers; at the deadline each stream ends with its API's error event ([DONE] after it on the chat
stream, whose error event carries the usage it asked for: the access log's counts; the Responses
API's typed, numbered ``error`` event, the response never completed) and the non-stream request
gets a 503 envelope. The access log's line of each cut request says it
was cut. The process exits 0 with a one-line summary and no traceback.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.server import spec_check
from tests.server.live import LiveServer, live_server

DRAIN = 4
REQUEST_ID = re.compile(r"[0-9a-f]{32}")
CUT_MESSAGE = (
    f"the server is shutting down: this request was still running at the end of the {DRAIN}s "
    "drain (--drain-timeout)"
)
STORY = [{"role": "user", "content": "Write a very long story about the sea."}]
LONG_CHAT = {"messages": STORY, "max_tokens": 1800, "ignore_eos": True}
LONG_STREAM = LONG_CHAT | {"stream": True}
REPEAT = [
    {"role": "user", "content": "Write the word apple nine hundred times."},
    {"role": "assistant", "content": "apple " * 200},  # a loop greedy decoding keeps to
]


@dataclass
class Outcome:
    status: int = 0
    request_id: str = ""
    lines: list[str] = field(default_factory=list)
    body: Any = None
    first: threading.Event = field(default_factory=threading.Event)


def _stream(url: str, body: dict[str, Any], headers: dict[str, str], out: Outcome) -> None:
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", url, json=body, headers=headers) as resp,
    ):
        out.status, out.request_id = resp.status_code, resp.headers["x-request-id"]
        for line in resp.iter_lines():
            out.lines.append(line)
            out.first.set()


def _post(url: str, body: dict[str, Any], headers: dict[str, str], out: Outcome) -> None:
    resp = httpx.post(url, json=body, headers=headers, timeout=120)
    out.status, out.request_id, out.body = (
        resp.status_code,
        resp.headers["x-request-id"],
        resp.json(),
    )


def _started(log: Path, request_id: str) -> bool:
    return f"request_start request_id={request_id} " in log.read_text(errors="replace")


def _wait(condition: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _events(lines: list[str]) -> list[str]:
    return [line for line in lines if line]


def test_sigterm_drains_then_cuts_cleanly(smollm2_gguf: Path, tmp_path: Path) -> None:
    args = [
        *("-m", str(smollm2_gguf), "--dtype", "f32", "--max-seqs", "5", "--max-seq-len", "2048"),
        *("--drain-timeout", str(DRAIN), "--body-timeout", "300", "--access-log-format", "text"),
        # prompt-lookup speculation runs the repeated-word stream several tokens a step, fast
        # enough to finish within the drain; this test needs requests that cannot
        *("--speculative", "off"),
    ]
    log = tmp_path / "serve.log"
    cut_usage: dict[str, dict[str, int]] = {}
    with live_server(args, log) as server:
        cut = _drain_and_cut(server, server.process, cut_usage)
    text = log.read_text(errors="replace")
    assert "Traceback" not in text and "Exception in ASGI application" not in text, text[-3000:]
    summary = [line for line in text.splitlines() if line.startswith("inferd  stopped")]
    assert summary == [
        f"inferd  stopped    1 request(s) finished during the drain, 4 cut at the {DRAIN}s "
        "deadline (--drain-timeout)"
    ]
    ends = {
        request_id: line
        for line in text.splitlines()
        for request_id in [*cut, "slow-body-1"]
        if f" request_end request_id={request_id} " in line
    }
    for request_id in cut:  # said to be cut, not complete
        assert " outcome=error " in ends[request_id] + " ", ends[request_id]
        assert ends[request_id].endswith(" error=shutdown"), ends[request_id]
    for request_id, usage in cut_usage.items():  # the stream's figures are the log's
        for key in ("prompt_tokens", "completion_tokens"):
            assert f" {key}={usage[key]} " in ends[request_id], (usage, ends[request_id])
    assert " outcome=complete" in ends["slow-body-1"] and "error=" not in ends["slow-body-1"]


def _drain_and_cut(
    server: LiveServer, proc: subprocess.Popen[bytes], cut_usage: dict[str, Any]
) -> list[str]:
    """Signal, check the drain and the cut; the request ids of the cut requests (and in
    ``cut_usage`` the usage on the error event of the stream that asked for it)."""
    port = int(server.url.rsplit(":", 1)[1])
    # a request whose body is half sent: running, and able to finish once the rest arrives
    body = json.dumps({"prompt": "Hello, world"}).encode()
    slow = socket.create_connection(("127.0.0.1", port), timeout=120)
    slow.sendall(
        f"POST /v1/tokenize HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        "Content-Type: application/json\r\nx-request-id: slow-body-1\r\nConnection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body[:10]
    )
    openai_stream, anthropic_stream, responses_stream, plain = (Outcome() for _ in range(4))
    anthropic_body = {
        "model": "default",
        "max_tokens": 1800,
        "messages": REPEAT,
        "temperature": 0,  # at the default 1.0 a sampled end_turn could finish it in the drain
        "stream": True,
    }
    responses_body = {
        "model": "default",
        "input": REPEAT,
        "temperature": 0,  # greedy decoding keeps to the loop (the API has no ignore_eos)
        "max_output_tokens": 1800,
        "stream": True,
    }
    workers = [
        threading.Thread(
            target=_stream,
            args=(
                server.api + "/chat/completions",
                LONG_STREAM | {"stream_options": {"include_usage": True}},
                {},
                openai_stream,
            ),
        ),
        threading.Thread(
            target=_stream,
            args=(
                server.api + "/messages",
                anthropic_body,
                {"anthropic-version": "2023-06-01"},
                anthropic_stream,
            ),
        ),
        threading.Thread(
            target=_stream,
            args=(server.api + "/responses", responses_body, {}, responses_stream),
        ),
        threading.Thread(
            target=_post,
            args=(server.api + "/chat/completions", LONG_CHAT, {"x-request-id": "plain-1"}, plain),
        ),
    ]
    for worker in workers:
        worker.start()
    _wait(openai_stream.first.is_set, "the OpenAI stream's first event")
    _wait(anthropic_stream.first.is_set, "the Anthropic stream's first event")
    _wait(responses_stream.first.is_set, "the Responses stream's first event")
    _wait(lambda: _started(server.log, "slow-body-1"), "the half-sent request")
    _wait(lambda: _started(server.log, "plain-1"), "the non-stream request")

    proc.send_signal(signal.SIGTERM)

    _wait(lambda: httpx.get(server.url + "/ready", timeout=30).status_code == 503, "draining")
    slow.sendall(body[10:])  # the half-sent request may now finish within the drain
    ready = httpx.get(server.url + "/ready", timeout=30)
    assert ready.headers["retry-after"] == "5" and REQUEST_ID.fullmatch(
        ready.headers["x-request-id"]
    )
    assert ready.json()["error"]["code"] == "server_shutting_down"
    assert httpx.get(server.url + "/health", timeout=30).json() == {"status": "ok"}
    refused = httpx.post(server.api + "/chat/completions", json=LONG_CHAT, timeout=30)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
    assert REQUEST_ID.fullmatch(refused.headers["x-request-id"])
    assert refused.json()["error"] == {
        "message": "the server is shutting down; retry on another instance or after its restart",
        "type": "service_unavailable",
        "param": None,
        "code": "server_shutting_down",
    }
    refused = httpx.post(
        server.api + "/messages",
        json={"model": "default", "max_tokens": 4, "messages": STORY},
        headers={"anthropic-version": "2023-06-01"},
        timeout=30,
    )
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "overloaded_error"

    raw = b""
    while chunk := slow.recv(65536):
        raw += chunk
    slow.close()
    head, _, answer = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"x-request-id: slow-body-1" in head
    assert json.loads(answer)["count"] > 0

    for worker in workers:
        worker.join(120)
    error = {"message": CUT_MESSAGE, "type": "service_unavailable", "param": None}
    events = _events(openai_stream.lines)
    assert openai_stream.status == 200 and REQUEST_ID.fullmatch(openai_stream.request_id)
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2].removeprefix("data: "))
    assert last["error"] == error | {"code": "server_shutting_down"}
    # it asked for usage: the server's count of what it generated before the cut
    usage, content = last["usage"], [e for e in events if '"content":"' in e]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["completion_tokens"] >= len(content) - 1  # the role chunk's content is ""
    cut_usage[openai_stream.request_id] = usage
    events = _events(anthropic_stream.lines)
    assert anthropic_stream.status == 200 and REQUEST_ID.fullmatch(anthropic_stream.request_id)
    assert events[-2] == "event: error"
    assert json.loads(events[-1].removeprefix("data: ")) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": CUT_MESSAGE},
        "request_id": anthropic_stream.request_id,
    }
    _check_responses_cut(responses_stream)
    assert plain.status == 503 and plain.request_id == "plain-1"
    assert plain.body == {"error": error | {"code": "server_shutting_down"}}
    assert proc.wait(120) == 0
    streams = (openai_stream, anthropic_stream, responses_stream)
    return [*(s.request_id for s in streams), plain.request_id]


def _check_responses_cut(out: Outcome) -> None:
    """The Responses stream ends with its typed error event, numbered after the events before
    it, as the API's spec describes it; no event reports the response completed."""
    assert out.status == 200 and REQUEST_ID.fullmatch(out.request_id)
    events = spec_check.parse_sse("\n".join(out.lines) + "\n\n")
    payloads = [e.json() for e in events]
    for event, payload in zip(events, payloads, strict=True):
        assert event.name == payload["type"]
        spec_check.check_responses_event(payload)
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    assert payloads[0]["type"] == "response.created"
    assert not any(p["type"].startswith("response.completed") for p in payloads)
    assert payloads[-1] == {
        "type": "error",
        "code": "server_shutting_down",
        "message": CUT_MESSAGE,
        "param": None,
        "sequence_number": len(payloads) - 1,
    }


def test_a_second_stop_cuts_at_once_and_a_cut_request_gets_a_503() -> None:
    """What a second SIGTERM/SIGINT does, on an app with no model: the first stop() starts a
    drain of 600 s, the second ends it now; the request still reading its body is cut."""
    import uvicorn

    from inferd.bench.process import free_port
    from inferd.server.app import build_app
    from inferd.server.options import ServerOptions
    from inferd.server.shutdown import HttpServer

    app = build_app([], ServerOptions(access_log_format=None))
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    http = HttpServer(config, app.state.drain, drain_timeout=600)
    http.start()
    _wait(lambda: http.started, "the server")
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(
            f"POST /v1/tokenize HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{".encode()
        )
        _wait(lambda: app.state.drain.running == 1, "the request to start")
        http.stop()
        _wait(lambda: app.state.drain.draining, "the drain")
        http.stop()
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    http.join(60)
    assert not http.is_alive()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and b"retry-after: 5" in head
    assert REQUEST_ID.search(head.decode())
    assert json.loads(body)["error"] == {
        "message": "the server is shutting down: this request was cut by a second stop signal",
        "type": "service_unavailable",
        "param": None,
        "code": "server_shutting_down",
    }
    assert http.report is not None
    assert http.report.summary() == (
        "stopped    0 request(s) finished during the drain, 1 cut by a second stop signal "
        "(--drain-timeout)"
    )
