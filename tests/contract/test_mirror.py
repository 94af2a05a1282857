"""The mirroring proxy (contract/mirror.py) between a caller and two stand-in releases on
loopback: which requests are mirrored, that callers get the live release's bytes and never wait
for the candidate, that a full queue drops mirrors rather than holding callers, and what the
comparison reports; that a chunked request body is decoded and forwarded whole, and broken
framing refused. The canary with real releases is in test_gate_live.py."""

from __future__ import annotations

import io
import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from inferd.bench.process import free_port
from inferd.contract.gate import mirror_rows
from inferd.contract.mirror import (
    BodyError,
    ChatAnswer,
    MirrorProxy,
    chat_answer,
    divergences,
    mirrored,
    read_chunked,
)


@dataclass
class Release:
    """A stand-in release: answers a chat request with its last message's text, upper-cased
    when ``shout`` (an altered template); streams it word by word when asked. ``gate``, when
    set, holds every answer until it is opened."""

    shout: bool = False
    gate: threading.Event | None = None
    seen: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""

    def answer(self, body: dict[str, Any]) -> str:
        text = body["messages"][-1]["content"]
        return text.upper() if self.shout else text


@contextmanager
def _serve(release: Release) -> Iterator[Release]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self._send(200, "application/json", b'{"object":"list","data":[]}')

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            release.seen.append(body)
            if release.gate is not None:
                release.gate.wait()
            text = release.answer(body)
            usage = {"prompt_tokens": len(text), "completion_tokens": 1, "total_tokens": 1}
            if not body.get("stream"):
                message = {"role": "assistant", "content": text}
                choice = {"index": 0, "message": message, "finish_reason": "stop"}
                reply = {"id": "x", "choices": [choice], "usage": usage | {"total_tokens": 9}}
                self._send(200, "application/json", json.dumps(reply).encode())
                return
            events = [{"choices": [{"index": 0, "delta": {"content": w}}]} for w in text.split()]
            events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
            events.append({"choices": [], "usage": usage})
            data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
            self._send(200, "text/event-stream", data + b"data: [DONE]\n\n")

        def _send(self, status: int, content_type: str, data: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("x-release", "shout" if release.shout else "plain")
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    release.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield release
    finally:
        if release.gate is not None:
            release.gate.set()
        server.shutdown()
        server.server_close()


@pytest.fixture
def live() -> Iterator[Release]:
    with _serve(Release()) as release:
        yield release


@pytest.fixture
def altered() -> Iterator[Release]:
    with _serve(Release(shout=True)) as release:
        yield release


def _body(i: int, **extra: Any) -> dict[str, Any]:
    content = f"request {i} about the sea"
    return {"model": "live", "messages": [{"role": "user", "content": content}], **extra}


def _send(client: httpx.Client, url: str, body: dict[str, Any], rid: str) -> httpx.Response:
    headers = {"x-request-id": rid, "content-type": "application/json"}
    return client.post(url + "/v1/chat/completions", content=_bytes(body), headers=headers)


def _bytes(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def test_mirroring_is_decided_by_the_request_digest() -> None:
    bodies = [_bytes(_body(i)) for i in range(400)]
    assert not any(mirrored(b, 0.0) for b in bodies) and all(mirrored(b, 1.0) for b in bodies)
    share = [mirrored(b, 0.25) for b in bodies]
    assert share == [mirrored(b, 0.25) for b in bodies]  # the same request, the same answer
    assert 40 < sum(share) < 160  # about a quarter of 400


def test_callers_get_the_live_answers_and_the_mirrored_share_is_compared(
    live: Release, altered: Release
) -> None:
    bodies = [_body(i, temperature=0, stream=i % 2 == 1) for i in range(12)]
    with (
        MirrorProxy(live.url, altered.url, "candidate", 0.5) as proxy,
        httpx.Client(timeout=30) as client,
    ):
        for i, body in enumerate(bodies):
            through = _send(client, proxy.url, body, f"req-{i}")
            direct = _send(client, live.url, body, f"direct-{i}")
            assert through.content == direct.content and through.status_code == 200
            assert through.headers["x-release"] == "plain"
        assert client.get(proxy.url + "/v1/models").json() == {"object": "list", "data": []}
    expected = {f"req-{i}" for i, b in enumerate(bodies) if mirrored(_bytes(b), 0.5)}
    assert 0 < len(expected) < len(bodies)
    records = {r.request_id: r for r in proxy.stats.records}
    assert set(records) == expected and proxy.stats.chat_requests == len(bodies)
    assert all(r.compared and any("text" in d for d in r.divergences) for r in records.values())
    assert {b["model"] for b in altered.seen} == {"candidate"}  # the candidate's own route
    rows = mirror_rows(proxy.stats, 0.5)
    assert [r.name for r in rows[:-1]] == [r.request_id for r in proxy.stats.records]
    assert not any(r.passed for r in rows[:-1]) and rows[-1].passed
    assert f"{len(expected)} of 12 chat requests mirrored" in rows[-1].detail


def test_an_unchanged_candidate_gives_the_same_answers_and_sampling_is_not_compared(
    live: Release,
) -> None:
    with (
        _serve(Release()) as candidate,
        MirrorProxy(live.url, candidate.url, "candidate", 1.0) as proxy,
        httpx.Client(timeout=30) as client,
    ):
        _send(client, proxy.url, _body(1, temperature=0), "greedy")
        _send(client, proxy.url, _body(2, temperature=0, stream=True), "greedy-stream")
        _send(client, proxy.url, _body(3, temperature=0.8), "sampled")
    rows = {r.name: r for r in mirror_rows(proxy.stats, 1.0)}
    assert rows["greedy"].passed and rows["greedy"].detail == "same answer"
    assert rows["greedy-stream"].passed and rows["sampled"].detail == "sampled: sent, not compared"


def test_a_stalled_candidate_never_holds_a_caller_and_a_full_queue_drops_mirrors(
    live: Release,
) -> None:
    """Every caller is answered while the candidate answers nothing: the mirrors wait in the
    queue (two fit, one is in the worker's hands), the rest are dropped and counted."""
    stalled = threading.Event()
    with (
        _serve(Release(gate=stalled)) as candidate,
        MirrorProxy(live.url, candidate.url, "candidate", 1.0, queue_size=2) as proxy,
        httpx.Client(timeout=30) as client,
    ):
        for i in range(6):
            assert _send(client, proxy.url, _body(i, temperature=0), f"r{i}").status_code == 200
        assert len(live.seen) == 6 and not proxy.stats.records
        stalled.set()  # the candidate answers: the queued mirrors are compared at exit
    assert proxy.stats.chat_requests == 6
    assert len(proxy.stats.records) + proxy.stats.dropped == 6
    assert proxy.stats.dropped >= 3  # at most one taken by the worker, two queued


def test_chat_answers_are_read_the_same_streamed_or_not() -> None:
    message = {"content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}
    whole = {"choices": [{"message": message, "finish_reason": "tool_calls"}], "usage": {}}
    calls = [
        {"index": 0, "function": {"name": "f", "arguments": ""}},
        {"index": 0, "function": {"arguments": "{}"}},
    ]
    sse = b"".join(
        b"data: " + json.dumps({"choices": [c]}).encode() + b"\n\n"
        for c in [
            {"index": 0, "delta": {"tool_calls": calls[:1]}},
            {"index": 0, "delta": {"tool_calls": calls[1:]}},
            {"index": 0, "delta": {}, "finish_reason": "tool_calls"},
        ]
    )
    a = chat_answer(200, "application/json", json.dumps(whole).encode())
    b = chat_answer(200, "text/event-stream", sse + b"data: [DONE]\n\n")
    assert a == b == ChatAnswer(200, "tool_calls", "", (("f", "{}"),), None)
    cut = chat_answer(200, "text/event-stream", b'data: {"error": {"code": "abort"}}\n\n')
    assert divergences(a, cut) == [
        "finish_reason 'tool_calls' -> 'error'",
        "tool_calls (('f', '{}'),) -> ()",
    ]
    assert divergences(a, ChatAnswer(503))[0] == "status 200 -> 503"


def test_a_live_release_that_does_not_answer_is_a_502_in_an_error_envelope(
    live: Release,
) -> None:
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with MirrorProxy(gone, live.url, "candidate", 1.0) as proxy, httpx.Client(timeout=30) as c:
        resp = _send(c, proxy.url, _body(1, temperature=0), "r1")
    assert resp.status_code == 502 and "did not answer" in resp.json()["error"]["message"]
    assert not live.seen and not proxy.stats.records  # nothing answered: nothing to mirror


def test_a_chunked_request_body_is_forwarded_whole_and_mirrored(
    live: Release, altered: Release
) -> None:
    """httpx sends an iterator's pieces in chunked coding: the live release gets the body whole
    (with its length), the caller its answer, and the mirror the same request."""
    data = _bytes(_body(1, temperature=0, stream=True))
    pieces = [data[:7], data[7:30], data[30:]]
    headers = {"x-request-id": "chunked", "content-type": "application/json"}
    with (
        MirrorProxy(live.url, altered.url, "candidate", 1.0) as proxy,
        httpx.Client(timeout=30) as client,
    ):
        through = client.post(
            proxy.url + "/v1/chat/completions", content=iter(pieces), headers=headers
        )
        assert through.request.headers["transfer-encoding"] == "chunked"
        direct = _send(client, live.url, json.loads(data), "direct")
    assert through.status_code == 200 and through.content == direct.content
    assert live.seen[0] == json.loads(data)
    (record,) = proxy.stats.records
    assert record.request_id == "chunked" and record.compared and record.divergences


CHUNKED = b"Transfer-Encoding: chunked\r\n"


@pytest.mark.parametrize(
    ("framing", "status"),
    [
        (CHUNKED + b"\r\nzz\r\n{}\r\n0\r\n\r\n", 400),  # not a hex size
        (CHUNKED + b"\r\n-2\r\n{}\r\n0\r\n\r\n", 400),
        (CHUNKED + b"\r\n9\r\n{}\r\n0\r\n\r\n", 400),  # its size runs past what was sent
        (CHUNKED + b"\r\nffffffff\r\n{}", 413),  # over the proxy's bound: refused unread
        (b"Content-Length: 2x\r\n\r\n{}", 400),
        (b"Content-Length: %d\r\n\r\n{}" % (1 << 30), 413),
    ],
)
def test_a_body_the_proxy_cannot_forward_is_refused_before_any_release_sees_it(
    live: Release, framing: bytes, status: int
) -> None:
    with MirrorProxy(live.url, live.url, "candidate", 1.0) as proxy:
        port = int(proxy.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + framing)
            sock.shutdown(socket.SHUT_WR)  # all sent: a short chunk meets the end
            raw = b""
            while chunk := sock.recv(65536):
                raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), raw
    assert json.loads(body)["error"]["type"] == "proxy_error"
    assert not live.seen and not proxy.stats.records


def test_chunked_coding_is_decoded_extensions_and_trailers_aside() -> None:
    framing = b'4;name=value\r\n{"a"\r\n3\r\n: 1\r\n1\r\n}\r\n0\r\nDigest: x\r\n\r\nNEXT'
    stream = io.BytesIO(framing)
    assert read_chunked(stream) == b'{"a": 1}' and stream.read() == b"NEXT"
    with pytest.raises(BodyError) as refused:
        read_chunked(io.BytesIO(b"5\r\nabcde\r\n0\r\n\r\n"), limit=4)
    assert refused.value.status == 413
    with pytest.raises(BodyError, match="unterminated"):
        read_chunked(io.BytesIO(b"5\r\nabcde\r\n"))  # the connection ended mid-body
