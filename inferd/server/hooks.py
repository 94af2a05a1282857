"""Stream hooks for applications that embed inferd: a callback for each streamed chunk (which may
replace it) and one when the stream ends, with every chunk and how it ended.

They wrap the ASGI app rather than each route, so every SSE route (chat and text completions,
Anthropic messages) calls them the same way, and a route needs no knowledge of them. Hooks may be
plain functions or coroutines; one that raises is logged and skipped, never breaking a stream.

    def on_chunk(info: StreamInfo, chunk: dict) -> dict | None   # None keeps the chunk as is
    def on_done(info: StreamInfo, summary: StreamSummary) -> None
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferd.server.envelope import app_path

log = logging.getLogger(__name__)

Outcome = Literal["complete", "error", "disconnected"]


@dataclass(frozen=True, slots=True)
class StreamInfo:
    request_id: str | None
    path: str  # the route's path inside the inferd app (a mount prefix removed)
    method: str


@dataclass(slots=True)
class StreamSummary:
    chunks: list[dict[str, Any]] = field(default_factory=list)  # as sent, after on_chunk
    events: list[str | None] = field(default_factory=list)  # SSE event names (Anthropic)
    outcome: Outcome = "complete"
    error: dict[str, Any] | None = None  # the error event's payload, if the stream failed


OnChunk = Callable[[StreamInfo, dict[str, Any]], "dict[str, Any] | Awaitable[Any] | None"]
OnDone = Callable[[StreamInfo, StreamSummary], "Awaitable[None] | None"]


@dataclass(frozen=True, slots=True)
class StreamHooks:
    on_chunk: OnChunk | None = None
    on_done: OnDone | None = None

    def __bool__(self) -> bool:
        return self.on_chunk is not None or self.on_done is not None


class StreamHooksMiddleware:
    def __init__(self, app: ASGIApp, hooks: StreamHooks) -> None:
        self.app = app
        self.hooks = hooks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        stream = _Stream(self.hooks, scope)

        async def send_hooked(message: Message) -> None:
            if message["type"] == "http.response.start":
                stream.start(message)
            elif message["type"] == "http.response.body" and stream.active:
                message = {**message, "body": await stream.feed(message)}
            await send(message)

        try:
            await self.app(scope, receive, send_hooked)
        finally:
            await stream.finish()


class _Stream:
    def __init__(self, hooks: StreamHooks, scope: Scope) -> None:
        self.hooks = hooks
        self.info = StreamInfo(
            request_id=(scope.get("state") or {}).get("request_id"),
            path=app_path(scope),
            method=str(scope.get("method", "")),
        )
        self.active = False
        self.ended = False
        self.buffer = b""
        self.summary = StreamSummary()

    def start(self, message: Message) -> None:
        for key, value in message.get("headers", []):
            if key.lower() == b"content-type" and value.startswith(b"text/event-stream"):
                self.active = True

    async def feed(self, message: Message) -> bytes:
        self.buffer += message.get("body", b"")
        out = []
        while b"\n\n" in self.buffer:
            raw, self.buffer = self.buffer.split(b"\n\n", 1)
            out.append(await self._event(raw) + b"\n\n")
        if not message.get("more_body", False):
            out.append(self.buffer)
            self.buffer = b""
            self.ended = True
        return b"".join(out)

    async def _event(self, raw: bytes) -> bytes:
        lines = raw.split(b"\n")
        name = next((ln[6:].strip().decode() for ln in lines if ln.startswith(b"event:")), None)
        data = [ln[5:].removeprefix(b" ") for ln in lines if ln.startswith(b"data:")]
        if not data or data == [b"[DONE]"]:
            return raw
        try:
            payload = json.loads(b"\n".join(data))
        except ValueError:
            return raw
        if not isinstance(payload, dict):
            return raw
        replaced = await self._call(self.hooks.on_chunk, payload)
        if isinstance(replaced, dict):
            payload = replaced
            encoded = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
            head = [ln for ln in lines if not ln.startswith(b"data:")]
            raw = b"\n".join([*head, b"data: " + encoded])
        self.summary.chunks.append(payload)
        self.summary.events.append(name)
        if name == "error" or ("error" in payload and payload.get("type") in (None, "error")):
            self.summary.outcome = "error"
            self.summary.error = payload
        return raw

    async def finish(self) -> None:
        if not self.active:
            return
        if not self.ended and self.summary.outcome != "error":
            self.summary.outcome = "disconnected"
        await self._call(self.hooks.on_done, self.summary)

    async def _call(self, hook: Callable[..., Any] | None, arg: Any) -> Any:
        if hook is None:
            return None
        try:
            result = hook(self.info, arg)
            if inspect.isawaitable(result):
                result = await result
            return result
        except Exception:
            log.exception("stream hook %s failed", getattr(hook, "__name__", hook))
            return None
