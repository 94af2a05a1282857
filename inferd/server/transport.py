"""Slow and surplus connections: a head timeout, a body timeout and a connection cap.

A client that opens connections and sends nothing, or sends a head or a body a byte at a
time, would otherwise hold each connection (and its socket) for as long as it likes: uvicorn
times out idle keep-alive connections only between requests.

- Head timeout (``--header-timeout``, uvicorn level): from a connection's start, or from the
  end of the previous response on it, the next request head must arrive complete within the
  timeout. ``GuardedH11Protocol`` keeps the timer; when it fires on a connection that sent
  part of a head, it answers 408 in the OpenAI envelope (Anthropic's for /v1/messages) with
  an ``x-request-id`` and closes; an idle connection is closed without a word (a client may be
  about to reuse it, and would read a 408 meant for no request as its own answer).
- Body timeout (``--body-timeout``, ASGI level, ``TransportMiddleware``): the body must arrive
  within the timeout of its head, plus one second per ``MIN_BODY_RATE`` bytes received, so a
  large upload on a slow link passes while a stalled or trickling one is cut with a 408 in the
  caller's envelope and ``Connection: close``.
- Connection cap (``--max-connections``): a connection opened while that many are open gets,
  for its request, 503 with ``Retry-After`` and ``Connection: close``; the protocol marks it,
  the middleware answers, so the refusal carries the envelope and the request id.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from inferd.server.defaults import DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_CONNECTIONS
from inferd.server.envelope import error_body, error_response, header

OVER_CAPACITY = "inferd.over_capacity"  # scope["state"] key: the cap the connection went over
MIN_BODY_RATE = 32 * 1024  # bytes per second a body may slow to without being cut


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    max_connections: int | None = DEFAULT_MAX_CONNECTIONS

    def __post_init__(self) -> None:
        if self.header_timeout <= 0:
            raise ValueError("the header timeout must be positive")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError("max connections must be at least 1")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the head timeout and the connection cap (see module note)."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        cap = self.limits.max_connections
        if cap is not None and len(self.connections) > cap:
            self.app_state = {**self.app_state, OVER_CAPACITY: cap}  # this connection's copy
        self._sync_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._sync_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._sync_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _sync_head_timer(self) -> None:
        """Armed while the connection owes us a request: before its head arrives, and after
        an answer while the rest of an unread body comes in."""
        waiting = self.conn.our_state in (h11.IDLE, h11.DONE)
        if waiting and not self.transport.is_closing():
            if self._head_timer is None:
                timeout = self.limits.header_timeout
                self._head_timer = self.loop.call_later(timeout, self._head_timed_out)
        else:
            self._cancel_head_timer()

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        pending, _ = self.conn.trailing_data
        if self.conn.our_state is h11.IDLE and pending:
            self.transport.write(_head_timeout_response(pending, self.limits.header_timeout))
        self.transport.close()


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """The protocol class to hand uvicorn (``Config(http=...)``) for these limits."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})


def _head_timeout_response(pending: bytes, timeout: float) -> bytes:
    """A raw 408 for a head that stopped halfway; its complete lines pick the envelope."""
    lines = pending.split(b"\r\n")
    target = lines[0].split(b" ")
    path = target[1].partition(b"?")[0].decode("latin-1") if len(target) > 1 else "/"
    headers = []
    for line in lines[1:-1]:  # the last one may be cut short
        name, sep, value = line.partition(b":")
        if sep:
            headers.append((name.strip().lower(), value.strip()))
    request_id = uuid.uuid4().hex
    scope = {"type": "http", "path": path, "headers": headers, "state": {"request_id": request_id}}
    message = f"the request head did not arrive within {timeout:g}s (--header-timeout)"
    body = json.dumps(error_body(scope, 408, message, code="header_timeout")).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n"
        f"x-request-id: {request_id}\r\n\r\n"
    )
    return head.encode() + body


class TransportMiddleware:
    """The body timeout and the connection cap's refusal (see the module note)."""

    def __init__(self, app: ASGIApp, *, body_timeout: float | None) -> None:
        if body_timeout is not None and body_timeout <= 0:
            raise ValueError("the body timeout must be positive")
        self.app = app
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cap = scope.get("state", {}).get(OVER_CAPACITY)
        if cap is not None:
            message = (
                f"this server is at its limit of {cap} open connections (--max-connections); "
                "retry shortly"
            )
            headers = {"Retry-After": "1", "Connection": "close"}
            response = error_response(
                scope, 503, message, code="too_many_connections", headers=headers
            )
            await response(scope, receive, send)
            return
        if self.body_timeout is None or not _has_body(scope):
            await self.app(scope, receive, send)
            return
        await self._with_body_timeout(self.body_timeout, scope, receive, send)

    async def _with_body_timeout(
        self, timeout: float, scope: Scope, receive: Receive, send: Send
    ) -> None:
        start = asyncio.get_running_loop().time()
        deadline = asyncio.timeout(start + timeout)
        received = 0
        started = False

        async def timed_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request" and not started:
                received += len(message.get("body", b""))
                more = message.get("more_body", False)
                deadline.reschedule(start + timeout + received / MIN_BODY_RATE if more else None)
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                deadline.reschedule(None)  # answered: the body holds nothing up any more
            await send(message)

        try:
            async with deadline:
                await self.app(scope, timed_receive, tracked_send)
        except TimeoutError:
            if started or not deadline.expired():
                raise
            message = (
                f"the request body did not arrive in time: {received} bytes in "
                f"{asyncio.get_running_loop().time() - start:.0f}s (--body-timeout {timeout:g}s, "
                f"plus a second per {MIN_BODY_RATE // 1024} KiB received)"
            )
            response = error_response(
                scope, 408, message, code="body_timeout", headers={"Connection": "close"}
            )
            await response(scope, receive, send)


def _has_body(scope: Scope) -> bool:
    if header(scope, b"transfer-encoding") is not None:
        return True
    length = header(scope, b"content-length")
    return length is not None and length.strip() not in ("", "0")
