"""Graceful shutdown: drain running requests, then cut the rest cleanly.

``Drain`` knows every request the app is answering (``DrainMiddleware`` registers each one).
``Drain.run(timeout)`` stops admitting at once: new requests get 503 with ``Retry-After`` and
``Connection: close`` (``/ready`` too, so a load balancer stops sending; ``/health`` and
``/metrics`` still answer), running requests may finish until the deadline, and those still
running then are cut: an event stream ends with an error event (then ``data: [DONE]`` on
OpenAI-style streams; Anthropic's ``event: error``; the Responses API's typed ``error`` event),
a request whose answer has not started gets a 503 envelope, and the access log records each
cut request with ``error=shutdown``. An OpenAI-style stream whose caller asked for usage has it
on its error event, as on any failed stream: the access log's count of what was generated.
Cutting cancels the handler, which aborts its engine requests and so frees their KV blocks.

``HttpServer`` runs uvicorn on a background thread (the main thread steps the engines) and
turns ``stop()`` (from a signal handler) into that drain before uvicorn itself shuts down; a
second ``stop()`` cuts what is left at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from inferd.server.envelope import app_path, error_response, stream_error_event
from inferd.server.metrics import TIMER_KEY, RequestTimer, cut_usage
from inferd.server.response_tracker import ResponseTracker

log = logging.getLogger("inferd")

ALWAYS_OPEN = frozenset({"/health", "/metrics"})  # liveness and scraping last to the end
RETRY_AFTER = "5"
CUT_GRACE = 5.0  # seconds cut requests get to send their last event
UVICORN_GRACE = 5  # seconds uvicorn waits for connections once nothing runs


@dataclass(eq=False, slots=True)
class _Running:
    """One request being answered, and how far its answer got."""

    scope: Scope
    cancel: asyncio.Timeout | None = None
    response: ResponseTracker = field(default_factory=ResponseTracker)
    cut: bool = False


@dataclass(frozen=True, slots=True)
class DrainReport:
    finished: int  # running when the drain began, finished before the deadline
    cut: int  # still running at the deadline, ended with an error
    timeout: float
    early: bool = False  # cut by a second stop before the deadline

    def summary(self) -> str:
        when = "by a second stop signal" if self.early else f"at the {self.timeout:g}s deadline"
        return (
            f"stopped    {self.finished} request(s) finished during the drain, {self.cut} cut "
            f"{when} (--drain-timeout)"
        )


@dataclass(eq=False)
class Drain:
    """The requests being answered, and the drain that ends them. One per app."""

    draining: bool = False
    timeout: float = 0.0
    early: bool = False  # the wait was ended by cut_now()
    _running: set[_Running] = field(default_factory=set)
    _idle: asyncio.Event | None = None
    _cut_now: asyncio.Event | None = None

    @property
    def running(self) -> int:
        """Requests being answered now."""
        return len(self._running)

    def add(self, running: _Running) -> None:
        self._running.add(running)

    def discard(self, running: _Running) -> None:
        self._running.discard(running)
        if not self._running and self._idle is not None:
            self._idle.set()

    def cut_now(self) -> None:
        """End the drain's wait at once (a second signal)."""
        if self._cut_now is not None:
            self._cut_now.set()

    async def run(self, timeout: float) -> DrainReport:
        """Stop admitting, wait up to ``timeout`` seconds for running requests, cut the rest."""
        self.draining, self.timeout = True, timeout
        self._idle, self._cut_now = asyncio.Event(), asyncio.Event()
        if not self._running:
            self._idle.set()
        running = len(self._running)
        if running:
            log.warning(
                "draining %d running request(s) for up to %gs (--drain-timeout); "
                "stop again to cut them now",
                running,
                timeout,
            )
        await _first(self._idle.wait(), self._cut_now.wait(), timeout=timeout)
        self.early = self._cut_now.is_set() and bool(self._running)
        cut = list(self._running)
        for request in cut:
            request.cut = True
            if request.cancel is not None:
                request.cancel.reschedule(asyncio.get_running_loop().time())
        await _first(self._idle.wait(), timeout=CUT_GRACE)
        return DrainReport(running - len(cut), len(cut), timeout, self.early)


async def _first(*waits: Coroutine[Any, Any, Any], timeout: float) -> None:
    """Until the first of ``waits`` is done, or ``timeout`` seconds."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class DrainMiddleware:
    def __init__(self, app: ASGIApp, *, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or app_path(scope) in ALWAYS_OPEN:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            response = error_response(
                scope,
                503,
                "the server is shutting down; retry on another instance or after its restart",
                code="server_shutting_down",
                headers={"Retry-After": RETRY_AFTER, "Connection": "close"},
            )
            await response(scope, receive, send)
            return
        running = _Running(scope)
        tracked_send = running.response.wrap(send)
        self.drain.add(running)
        try:
            async with asyncio.timeout(None) as running.cancel:
                await self.app(scope, receive, tracked_send)
        except TimeoutError:
            if not running.cut:
                raise
            await _answer_cut(running, send, self.drain, receive)
        finally:
            self.drain.discard(running)


async def _answer_cut(running: _Running, send: Send, drain: Drain, receive: Receive) -> None:
    progress = running.response
    if progress.finished:
        return
    scope = running.scope
    timer = (scope.get("state") or {}).get(TIMER_KEY)
    if isinstance(timer, RequestTimer):
        timer.error = "shutdown"  # the access log's line says the request was cut, not complete
    if drain.early:
        message = "the server is shutting down: this request was cut by a second stop signal"
    else:
        message = (
            f"the server is shutting down: this request was still running at the end of the "
            f"{drain.timeout:g}s drain (--drain-timeout)"
        )
    try:
        if not progress.started:
            response = error_response(
                scope,
                503,
                message,
                code="server_shutting_down",
                headers={"Retry-After": RETRY_AFTER, "Connection": "close"},
            )
            await response(scope, receive, send)
        elif progress.event_stream:
            event = stream_error_event(
                scope,
                message,
                "server_shutting_down",
                status=503,
                events_sent=progress.events,
                usage=cut_usage(scope),
            )
            await send({"type": "http.response.body", "body": event, "more_body": False})
        else:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
    except OSError:
        pass  # the client is gone too


class HttpServer:
    """uvicorn on a background thread, stopped by draining first (see the module note)."""

    def __init__(self, config: uvicorn.Config, drain: Drain, drain_timeout: float) -> None:
        self.server = uvicorn.Server(config)
        self.drain = drain
        self.drain_timeout = drain_timeout
        self.report: DrainReport | None = None
        self._thread = threading.Thread(target=self._run, name="inferd-http")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stops = 0
        self._lock = threading.Lock()

    @property
    def started(self) -> bool:
        return bool(self.server.started)

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def stop(self) -> None:
        """Begin the drain; a second call cuts running requests now. Safe from signal handlers
        and other threads."""
        with self._lock:
            self._stops += 1
            loop, first = self._loop, self._stops == 1
        if loop is None:  # not serving (yet, or any more): nothing to drain
            self.server.should_exit = True
            return
        assert self._stop is not None
        loop.call_soon_threadsafe(self._stop.set if first else self.drain.cut_now)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        finally:
            with self._lock:
                self._loop = None  # stop() after this has nothing left to do

    async def _serve(self) -> None:
        stop = asyncio.Event()
        with self._lock:
            self._loop, self._stop = asyncio.get_running_loop(), stop
            if self._stops:
                stop.set()
        serving = asyncio.ensure_future(self.server.serve())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set() and not serving.done():
            self.report = await self.drain.run(self.drain_timeout)
        stopping.cancel()
        self.server.should_exit = True
        await serving
