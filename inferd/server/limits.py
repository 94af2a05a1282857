"""Request limits as ASGI middleware: head size (431), body size (413), timeout (408/504).

Head size: uvicorn's h11 bound (``h11_max_incomplete_event_size``) stops a client from making
the server buffer an endless head, but a head that arrives in one read passes it; the exact
limit is checked here on the parsed request line and headers.

Body size: a ``Content-Length`` over the limit is refused before any of the body is read;
bodies without one (chunked) are counted as they stream in and refused at the first byte over.

Timeout: with --request-timeout the middleware puts a ``RequestDeadline`` in the request state,
covering the whole request. While the client is still sending the body, running out of time is
a 408. Generation code bounds every engine stream with ``deadline.bound`` (``generation.start``
does), which aborts the engine request and raises ``RequestTimeoutError``; before the response
starts that is a 504 in the caller's envelope, and once an event stream is under way the stream
ends with an error event (then ``data: [DONE]`` for OpenAI-style streams). A backstop cancels
handlers that do not consult the deadline shortly after it. The access log counts a request
whose deadline ``expired``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferd.server.defaults import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_HEADER_BYTES
from inferd.server.envelope import error_response, header, stream_error_event
from inferd.server.metrics import cut_usage
from inferd.server.response_tracker import ResponseTracker
from inferd.server.streams import close_stream
from inferd.serving.interface import RequestOutput

BACKSTOP_GRACE_SECONDS = 1.0
DEADLINE_KEY = "inferd_deadline"


class RequestTimeoutError(Exception):
    """The request ran past --request-timeout. ``phase`` is "body" or "generation"."""

    def __init__(self, timeout: float, phase: str = "generation") -> None:
        self.timeout = timeout
        self.phase = phase
        what = "sending the request body" if phase == "body" else "generating"
        super().__init__(
            f"the request timed out after {timeout:g}s (--request-timeout) while {what}"
        )


@dataclass(slots=True)
class RequestDeadline:
    """When a request must be answered by: ``at`` on the event loop's clock, ``timeout``
    seconds after it arrived. ``expired`` once anything ran into it."""

    timeout: float
    at: float
    expired: bool = False

    @classmethod
    def after(cls, timeout: float) -> RequestDeadline:
        return cls(timeout, asyncio.get_running_loop().time() + timeout)

    def expire(self, phase: str) -> RequestTimeoutError:
        self.expired = True
        return RequestTimeoutError(self.timeout, phase)

    async def bound(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """Pass ``outputs`` through until the deadline; then close it, which aborts the engine
        request and frees its KV blocks, and raise ``RequestTimeoutError``."""
        try:
            while True:
                try:
                    async with asyncio.timeout_at(self.at):
                        out = await anext(outputs)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise self.expire("generation") from None
                yield out
        finally:
            await close_stream(outputs)


def request_deadline(scope: Scope) -> RequestDeadline | None:
    """The request's deadline; None without --request-timeout (or outside the middleware)."""
    state: dict[str, Any] = scope.get("state") or {}
    deadline = state.get(DEADLINE_KEY)
    return deadline if isinstance(deadline, RequestDeadline) else None


class BodyTooLargeError(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(
            f"the request body is larger than this server's limit of {limit} bytes "
            "(--max-body-bytes)"
        )


@dataclass(slots=True)
class _Progress:
    received: int = 0
    body_done: bool = False
    response: ResponseTracker = field(default_factory=ResponseTracker)


class LimitsMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES,
        request_timeout: float | None = None,
        max_header_bytes: int | None = DEFAULT_MAX_HEADER_BYTES,
    ) -> None:
        # The values are checked where they are set (ServerOptions).
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.request_timeout = request_timeout
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        head_limit = self.max_header_bytes
        if head_limit is not None and _head_size(scope) > head_limit:
            message = (
                f"the request line and headers are larger than this server's limit of "
                f"{head_limit} bytes (--max-header-bytes)"
            )
            response = error_response(scope, 431, message, code="request_too_large")
            await response(scope, receive, send)
            return
        limit = self.max_body_bytes
        if limit is not None and _declared_length(scope) > limit:
            await error_response(
                scope, 413, str(BodyTooLargeError(limit)), code="request_too_large"
            )(scope, receive, send)
            return
        deadline = None
        if self.request_timeout is not None:
            deadline = RequestDeadline.after(self.request_timeout)
            scope.setdefault("state", {})[DEADLINE_KEY] = deadline
        progress = _Progress()

        async def limited_receive() -> Message:
            if progress.body_done or deadline is None:
                message = await receive()
            else:
                try:
                    async with asyncio.timeout_at(deadline.at):
                        message = await receive()
                except TimeoutError:
                    raise deadline.expire("body") from None
            if message["type"] == "http.request":
                progress.received += len(message.get("body", b""))
                if limit is not None and progress.received > limit:
                    raise BodyTooLargeError(limit)
                if not message.get("more_body", False):
                    progress.body_done = True
            return message

        tracked_send = progress.response.wrap(send)
        backstop = None
        if deadline is not None:
            backstop = asyncio.timeout_at(deadline.at + BACKSTOP_GRACE_SECONDS)
        try:
            if backstop is None:
                await self.app(scope, limited_receive, tracked_send)
            else:
                async with backstop:
                    await self.app(scope, limited_receive, tracked_send)
        except BodyTooLargeError as exc:
            if progress.response.started:
                raise
            await error_response(scope, 413, str(exc), code="request_too_large")(
                scope, receive, send
            )
        except RequestTimeoutError as exc:
            await _answer_timeout(scope, receive, send, progress.response, exc)
        except TimeoutError:
            if backstop is None or deadline is None or not backstop.expired():
                raise
            phase = "generation" if progress.body_done else "body"
            await _answer_timeout(scope, receive, send, progress.response, deadline.expire(phase))


async def _answer_timeout(
    scope: Scope, receive: Receive, send: Send, progress: ResponseTracker, exc: RequestTimeoutError
) -> None:
    if progress.finished:
        return
    try:
        if not progress.started:
            status = 408 if exc.phase == "body" else 504
            response = error_response(scope, status, str(exc), code="request_timeout")
            await response(scope, receive, send)
        elif progress.event_stream:
            event = stream_error_event(
                scope,
                str(exc),
                code="request_timeout",
                events_sent=progress.events,
                usage=cut_usage(scope),
            )
            await send({"type": "http.response.body", "body": event, "more_body": False})
    except OSError:
        pass  # the client is gone too


def _head_size(scope: Scope) -> int:
    """Bytes of the request line and headers as sent (give or take whitespace)."""
    size = len(scope.get("raw_path") or scope.get("path", "").encode()) + 16
    size += len(scope.get("query_string", b""))
    for key, value in scope.get("headers", []):
        size += len(key) + len(value) + 4
    return size


def _declared_length(scope: Scope) -> int:
    value = header(scope, b"content-length")
    if value is None:
        return -1
    try:
        return int(value.strip())
    except ValueError:
        return -1  # the HTTP layer rejects malformed lengths itself
