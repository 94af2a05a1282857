"""Send a built chat request over HTTP and validate its stream with the strict consumer.

The head is checked before any body byte is parsed; a non-2xx answer keeps only a short
sanitized prefix of its body. The body is read as raw network chunks (never re-chunked,
so one read is whatever TCP delivered) and fed to the same ``StreamConsumer`` the fixtures
use. ``LiveStream`` exposes one read at a time so callers can model slow consumers, client
drops and server crashes around it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from inferd.contract.request import ChatRequest
from inferd.contract.stream import (
    Expectation,
    Outcome,
    ProtocolError,
    StreamConsumer,
    StreamLimits,
    check_head,
    error_body_summary,
)


@dataclass(frozen=True)
class Head:
    status: int
    headers: tuple[tuple[str, str], ...]
    request_id: str | None


class LiveStream:
    def __init__(
        self,
        response: httpx.Response,
        request: ChatRequest,
        limits: StreamLimits,
        clock: Callable[[], float],
        sent_at: float,
    ) -> None:
        self.request = request
        self._clock = clock
        self._started = sent_at
        self.consumer = StreamConsumer(
            Expectation(request.model_route, request.max_tokens, request.include_usage),
            limits,
            started_at=0.0,
        )
        self._response = response
        self._chunks: Iterator[bytes] | None = None
        self._final: Outcome | None = None
        self.head = Head(
            response.status_code,
            tuple(response.headers.items()),
            response.headers.get("x-request-id"),
        )
        self._check_head(limits)

    def _check_head(self, limits: StreamLimits) -> None:
        broken = check_head(
            self.head.status, list(self.head.headers), self.request.request_id, limits
        )
        if broken is None:
            self._chunks = self._response.iter_raw()
            return
        rule, detail = broken
        if not 200 <= self.head.status < 300:
            detail = f"{detail}: {error_body_summary(self._body_prefix(limits))}"
        self._final = ProtocolError(rule, detail, "")

    def _body_prefix(self, limits: StreamLimits) -> bytes:
        prefix = bytearray()
        try:
            for chunk in self._response.iter_raw():
                prefix += chunk
                if len(prefix) >= limits.max_error_body_bytes:
                    break
        except httpx.HTTPError:
            pass
        return bytes(prefix[: limits.max_error_body_bytes])

    @property
    def outcome(self) -> Outcome | None:
        return self._final or self.consumer.outcome

    @property
    def text(self) -> str:
        return self.consumer.text

    def pump(self) -> bool:
        """Read and validate one network chunk; False once the outcome is decided."""
        if self._final is not None or self._chunks is None:
            return False
        if self.consumer.failed:
            self._final = self.consumer.outcome
            return False
        try:
            chunk = next(self._chunks)
        except StopIteration:
            self._final = self.consumer.finish(self._clock() - self._started)
            return False
        except httpx.ReadTimeout:
            self._final = self.consumer.timed_out()
            return False
        except httpx.HTTPError as exc:
            self._final = self.consumer.transport_failed(f"{type(exc).__name__}: {str(exc)[:120]}")
            return False
        self.consumer.feed(chunk, self._clock() - self._started)
        return True

    def run(self) -> Outcome:
        while self.pump():
            pass
        assert self.outcome is not None
        return self.outcome

    def cancel(self) -> Outcome:
        """Stop reading and close the connection, as a client that gives up would."""
        if self._final is None:
            self._final = self.consumer.cancel()
        self._response.close()
        return self._final


@contextmanager
def open_chat_stream(
    client: httpx.Client,
    base_url: str,
    request: ChatRequest,
    limits: StreamLimits | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[LiveStream]:
    """POST ``request`` and yield a ``LiveStream``; the connection is closed on exit."""
    limits = limits or StreamLimits()
    timeout = httpx.Timeout(10.0, read=limits.idle_timeout_s)
    sent_at = clock()
    with client.stream(
        "POST",
        base_url + request.endpoint,
        content=request.body,
        headers=request.headers(),
        timeout=timeout,
    ) as response:
        yield LiveStream(response, request, limits, clock, sent_at)
