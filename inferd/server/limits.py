"""Request limits as ASGI middleware: head size (431), body size (413), timeout (408/504).

Head size: uvicorn's h11 bound (``h11_max_incomplete_event_size``) stops a client from making
the server buffer an endless head, but a head that arrives in one read passes it; the exact
limit is checked here on the parsed request line and headers.

Body size: a ``Content-Length`` over the limit is refused before any of the body is read;
bodies without one (chunked) are counted as they stream in and refused at the first byte over.

Timeout: the deadline covers the whole request. While the client is still sending the body,
running out of time is a 408. Generation is bounded through ``RequestTimer.watch`` (see
metrics.py), which aborts the engine request and raises ``RequestTimeoutError``; before the
response starts that is a 504 in the caller's envelope, and once an event stream is under way
the stream ends with an error event (then ``data: [DONE]`` for OpenAI-style streams). A backstop
cancels handlers that do not go through ``watch`` shortly after the deadline.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferd.server.defaults import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_HEADER_BYTES
from inferd.server.envelope import error_response, header, stream_error_event
from inferd.server.metrics import TIMER_KEY, RequestTimeoutError, RequestTimer

BACKSTOP_GRACE_SECONDS = 1.0


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
    started: bool = False
    event_stream: bool = False
    finished: bool = False


class LimitsMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES,
        request_timeout: float | None = None,
        max_header_bytes: int | None = DEFAULT_MAX_HEADER_BYTES,
    ) -> None:
        if max_body_bytes is not None and max_body_bytes < 1:
            raise ValueError("max_body_bytes must be at least 1")
        if max_header_bytes is not None and max_header_bytes < 1024:
            raise ValueError("max_header_bytes must be at least 1024")
        if request_timeout is not None and request_timeout <= 0:
            raise ValueError("request_timeout must be positive")
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
        timer = scope.setdefault("state", {}).setdefault(TIMER_KEY, RequestTimer())
        assert isinstance(timer, RequestTimer)
        timeout = self.request_timeout
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        timer.deadline, timer.timeout = deadline, timeout
        progress = _Progress()

        async def limited_receive() -> Message:
            if progress.body_done or deadline is None or timeout is None:
                message = await receive()
            else:
                try:
                    async with asyncio.timeout_at(deadline):
                        message = await receive()
                except TimeoutError:
                    raise RequestTimeoutError(timeout, "body") from None
            if message["type"] == "http.request":
                progress.received += len(message.get("body", b""))
                if limit is not None and progress.received > limit:
                    raise BodyTooLargeError(limit)
                if not message.get("more_body", False):
                    progress.body_done = True
            return message

        async def tracked_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                progress.started = True
                for key, value in message.get("headers", []):
                    if key.lower() == b"content-type":
                        progress.event_stream = value.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                progress.finished = True
            await send(message)

        backstop = None
        if deadline is not None:
            backstop = asyncio.timeout_at(deadline + BACKSTOP_GRACE_SECONDS)
        try:
            if backstop is None:
                await self.app(scope, limited_receive, tracked_send)
            else:
                async with backstop:
                    await self.app(scope, limited_receive, tracked_send)
        except BodyTooLargeError as exc:
            if progress.started:
                raise
            await error_response(scope, 413, str(exc), code="request_too_large")(
                scope, receive, send
            )
        except RequestTimeoutError as exc:
            timer.error = "timeout"
            await _answer_timeout(scope, receive, send, progress, exc)
        except TimeoutError:
            if backstop is None or not backstop.expired():
                raise
            timer.error = "timeout"
            assert timeout is not None
            phase = "generation" if progress.body_done else "body"
            await _answer_timeout(
                scope, receive, send, progress, RequestTimeoutError(timeout, phase)
            )


async def _answer_timeout(
    scope: Scope, receive: Receive, send: Send, progress: _Progress, exc: RequestTimeoutError
) -> None:
    if progress.finished:
        return
    try:
        if not progress.started:
            status = 408 if exc.phase == "body" else 504
            response = error_response(scope, status, str(exc), code="request_timeout")
            await response(scope, receive, send)
        elif progress.event_stream:
            event = stream_error_event(scope, str(exc), code="request_timeout")
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
