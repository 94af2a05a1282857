"""Mirrored canary traffic: the live release answers every caller, and a share of its chat
requests goes to the candidate too, their answers compared.

``MirrorProxy`` listens on loopback and forwards every request to the live release as it came,
relaying the answer as it arrives: what the caller gets is the live release's answer. A body
sent with chunked transfer coding is decoded and forwarded with its length (the body is what
the mirror digests and resends); one whose length or framing is broken gets a 400, one past
``MAX_BODY_BYTES`` a 413, in the proxy's error envelope, and neither reaches a release. A chat
completion is mirrored when ``mirrored(body, share)`` says so: the body's sha256 read as a
fraction below the share, so one request is always mirrored or never, and a test knows which.
Only once the live answer has reached the caller does the request (its ``model`` set to the
candidate's route) go on a bounded queue, which one worker thread sends to the candidate: a
caller never waits for the candidate, and a mirror that finds the queue full is dropped and
counted rather than held. The answers of a greedy request (``temperature`` 0) are compared:
HTTP status, finish reason, text, tool calls and prompt tokens; a sampled one is sent but not
compared (its answers may differ on an unchanged release).
"""

from __future__ import annotations

import hashlib
import io
import json
import queue
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

CHAT_PATH = "/v1/chat/completions"
MAX_KEPT_BYTES = 8 << 20  # a live answer longer than this is not compared
MAX_BODY_BYTES = 64 << 20  # a request body the proxy holds (inferd serve's own cap is 16 MiB)
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")
_LENGTH = re.compile(r"[0-9]{1,20}")
_MAX_LINE = 8192  # a chunk-size line (with its extensions) or a trailer line
# Headers that describe one hop, not the message (RFC 9110, 7.6.1), and the ones the proxy
# sets itself.
_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


class BodyError(ValueError):
    """A request body the proxy cannot forward: ``status`` says why (400 or 413)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def read_chunked(stream: io.BufferedIOBase, limit: int = MAX_BODY_BYTES) -> bytes:
    """A body in chunked transfer coding (RFC 9112, 7.1), decoded: each chunk's hex size (its
    extensions ignored), its bytes and CRLF, up to the zero-size chunk; then the trailer
    fields, read and dropped (the forwarded request has a length, not a trailer)."""
    body = bytearray()
    while True:
        size_text = _line(stream).split(b";", 1)[0].strip(b" \t")
        if not _CHUNK_SIZE.fullmatch(size_text):
            raise BodyError(400, f"a chunk size must be hex digits, got {size_text[:32]!r}")
        size = int(size_text, 16)
        if size == 0:
            break
        if len(body) + size > limit:
            raise BodyError(413, f"the request body is over the proxy's {limit} bytes")
        chunk = stream.read(size)
        if len(chunk) != size or stream.read(2) != b"\r\n":
            raise BodyError(400, "a chunk ended before its size, or without CRLF")
        body += chunk
    while _line(stream):  # the trailer section ends with an empty line
        pass
    return bytes(body)


def _line(stream: io.BufferedIOBase) -> bytes:
    """One CRLF-ended line of the chunked framing, without its CRLF."""
    line = stream.readline(_MAX_LINE + 1)
    if not line.endswith(b"\r\n") or len(line) > _MAX_LINE:
        raise BodyError(400, "the chunked framing has an unterminated or overlong line")
    return line[:-2]


def mirrored(body: bytes, share: float) -> bool:
    """Whether a request with this body is mirrored at ``share`` (0..1), by its digest."""
    return int.from_bytes(hashlib.sha256(body).digest()[:8], "big") < share * 2**64


@dataclass(frozen=True)
class ChatAnswer:
    """What two releases' answers to one request are compared on."""

    status: int
    finish_reason: str | None = None
    text: str = ""
    tool_calls: tuple[tuple[str, str], ...] = ()  # (name, arguments) of each call, in order
    prompt_tokens: int | None = None


def chat_answer(status: int, content_type: str, body: bytes) -> ChatAnswer:
    """The first choice of a chat completion, streamed (SSE) or not."""
    if status != 200:
        return ChatAnswer(status)
    if content_type.startswith("text/event-stream"):
        return _streamed_answer(body)
    payload = json.loads(body)
    choice, usage = payload["choices"][0], payload.get("usage") or {}
    message = choice["message"]
    calls = tuple(
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or ()
    )
    text = message.get("content") or ""
    return ChatAnswer(200, choice["finish_reason"], text, calls, usage.get("prompt_tokens"))


def _streamed_answer(body: bytes) -> ChatAnswer:
    text: list[str] = []
    finish, prompt_tokens = None, None
    calls: dict[int, list[str]] = {}
    for line in body.decode("utf-8", errors="replace").splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line.removeprefix("data: "))
        if "error" in chunk and "object" not in chunk:
            return ChatAnswer(200, "error", "".join(text))  # cut mid-stream by the server
        prompt_tokens = (chunk.get("usage") or {}).get("prompt_tokens", prompt_tokens)
        for choice in chunk.get("choices") or ():
            if choice.get("index") != 0:
                continue
            delta = choice.get("delta") or {}
            text.append(delta.get("content") or "")
            for call in delta.get("tool_calls") or ():
                fn = call.get("function") or {}
                name_args = calls.setdefault(call.get("index", 0), ["", ""])
                name_args[0] += fn.get("name") or ""
                name_args[1] += fn.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    tool_calls = tuple((calls[i][0], calls[i][1]) for i in sorted(calls))
    return ChatAnswer(200, finish, "".join(text), tool_calls, prompt_tokens)


def divergences(live: ChatAnswer, candidate: ChatAnswer) -> list[str]:
    """What differs between the two answers ([]: the same answer)."""
    found = []
    for name in ("status", "finish_reason", "prompt_tokens", "tool_calls", "text"):
        before, after = getattr(live, name), getattr(candidate, name)
        if before != after:
            shown = (
                f"{before!r} -> {after!r}"
                if name != "text"
                else f"from character {_common_prefix(before, after)}"
            )
            found.append(f"{name} {shown}")
    return found


def _common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@dataclass(frozen=True)
class MirrorRecord:
    request_id: str
    compared: bool  # greedy: the answers were compared
    divergences: tuple[str, ...] = ()


@dataclass
class MirrorStats:
    chat_requests: int = 0  # chat completions the live release answered through the proxy
    dropped: int = 0  # mirrors the full queue turned away
    records: list[MirrorRecord] = field(default_factory=list)


@dataclass(frozen=True)
class _Mirror:
    request_id: str
    body: dict[str, Any]
    headers: tuple[tuple[str, str], ...]  # the caller's (its API key, its request id)
    live: ChatAnswer


class MirrorProxy:
    """The proxy in front of the live release (see the module doc); a context manager whose
    exit waits for the mirrors already queued, then stops."""

    def __init__(
        self,
        live_url: str,
        candidate_url: str,
        candidate_route: str,
        share: float,
        *,
        port: int = 0,
        queue_size: int = 64,
        timeout_s: float = 300.0,
    ) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"the mirrored share must be between 0 and 1, got {share}")
        self.live_url, self.candidate_url = live_url, candidate_url
        self.candidate_route, self.share = candidate_route, share
        self.stats = MirrorStats()
        self._lock = threading.Lock()
        self._queue: queue.Queue[_Mirror | None] = queue.Queue(queue_size)
        self._client = httpx.Client(trust_env=False, timeout=timeout_s)
        self._server = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self._threads = [
            threading.Thread(target=self._server.serve_forever, daemon=True),
            threading.Thread(target=self._mirror_all, daemon=True),
        ]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> MirrorProxy:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._queue.put(None)  # after every mirror queued before it
        self._threads[1].join()
        self._client.close()

    # -- the caller's side (handler threads) -----------------------------------------------
    def after_live_answer(
        self, body: bytes, headers: list[tuple[str, str]], live: ChatAnswer
    ) -> None:
        """Queue the mirror of a chat request the live release has answered, if it is one."""
        with self._lock:
            self.stats.chat_requests += 1
        if not mirrored(body, self.share):
            return
        try:
            request = json.loads(body)
        except ValueError:
            return  # the live release refused it too; there is nothing to compare
        sent = dict((k.lower(), v) for k, v in headers)
        rid = sent.get("x-request-id") or "sha256:" + hashlib.sha256(body).hexdigest()[:16]
        try:
            self._queue.put_nowait(_Mirror(rid, request, tuple(headers), live))
        except queue.Full:
            with self._lock:
                self.stats.dropped += 1

    # -- the worker ------------------------------------------------------------------------
    def _mirror_all(self) -> None:
        while (job := self._queue.get()) is not None:
            record = self._mirror(job)
            with self._lock:
                self.stats.records.append(record)

    def _mirror(self, job: _Mirror) -> MirrorRecord:
        body = {**job.body, "model": self.candidate_route}
        greedy = body.get("temperature") == 0
        try:
            response = self._client.post(
                self.candidate_url + CHAT_PATH, json=body, headers=list(job.headers)
            )
            answer = chat_answer(
                response.status_code, response.headers.get("content-type", ""), response.content
            )
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            return MirrorRecord(job.request_id, greedy, (f"the candidate failed: {exc}",))
        return MirrorRecord(
            job.request_id, greedy, tuple(divergences(job.live, answer)) if greedy else ()
        )


def _handler(proxy: MirrorProxy) -> type[BaseHTTPRequestHandler]:
    class Forward(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self._forward()

        do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = do_GET

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the live release logs the request; the proxy adds nothing to keep

        def _forward(self) -> None:
            try:
                body = self._request_body()
            except BodyError as exc:
                self._refuse(exc.status, str(exc))
                return
            headers = [(k, v) for k, v in self.headers.items() if k.lower() not in _HOP]
            chat = self.command == "POST" and self.path.split("?")[0] == CHAT_PATH
            kept, relayed = bytearray(), False
            try:
                with proxy._client.stream(
                    self.command, proxy.live_url + self.path, content=body, headers=headers
                ) as response:
                    has_body = self._relay_head(response)
                    relayed = True
                    for chunk in response.iter_bytes():
                        if has_body:
                            self._write_chunk(chunk)
                        if chat and len(kept) < MAX_KEPT_BYTES:
                            kept += chunk
                    if has_body:
                        self._write_chunk(b"")  # the last chunk
            except (httpx.HTTPError, OSError) as exc:
                if not relayed:
                    self._refuse(502, f"the live release did not answer: {type(exc).__name__}")
                self.close_connection = True  # the live release or the caller went away
                return
            if chat and len(kept) < MAX_KEPT_BYTES:
                content_type = response.headers.get("content-type", "")
                try:
                    live = chat_answer(response.status_code, content_type, bytes(kept))
                except (ValueError, KeyError, IndexError, TypeError):
                    return  # not a chat answer this proxy can compare
                proxy.after_live_answer(body, headers, live)

        def _request_body(self) -> bytes:
            """The caller's body, whole: its Content-Length's bytes, or its chunks decoded."""
            if "chunked" in self.headers.get("transfer-encoding", "").lower():
                return read_chunked(self.rfile)
            declared = self.headers.get("content-length") or "0"
            if not _LENGTH.fullmatch(declared):
                raise BodyError(400, f"Content-Length must be a byte count, got {declared[:32]!r}")
            length = int(declared)
            if length > MAX_BODY_BYTES:
                raise BodyError(413, f"the request body is over the proxy's {MAX_BODY_BYTES} bytes")
            return self.rfile.read(length)

        def _relay_head(self, response: httpx.Response) -> bool:
            """The live release's status and headers; whether a body follows (chunked)."""
            self.send_response_only(response.status_code, response.reason_phrase)
            for key, value in response.headers.multi_items():
                # the body is relayed decoded and re-framed
                if key.lower() not in _HOP and key.lower() != "content-encoding":
                    self.send_header(key, value)
            has_body = self.command != "HEAD" and response.status_code not in (204, 304)
            if has_body:
                self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            return has_body

        def _write_chunk(self, chunk: bytes) -> None:
            # each piece as it arrived, so a stream reaches the caller token by token
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()

        def _refuse(self, status: int, message: str) -> None:
            body = json.dumps({"error": {"message": message, "type": "proxy_error"}}).encode()
            self.send_response_only(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
            self.close_connection = True

    return Forward
