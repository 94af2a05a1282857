"""Access log and HTTP metrics: one middleware that sees every request from start to end.

Each request gets a ``RequestTimer`` (see metrics.py) in its state, two log lines on the
``inferd.access`` logger (``request_start`` and ``request_end``) and its HTTP series in the
metrics registry. Lines carry the route *pattern*, never the raw path or query, and never
bodies: prompts and media paths stay out of the log. ``--log-payloads FILE`` is the one way to
record bodies, as JSON lines in a separate file created with mode 0600.

Outcome of a request: ``client_disconnected`` when the client left before the response was
complete (or a handler answered 499); ``error`` when the status is 4xx/5xx, the handler raised,
or generation failed, timed out or was cut by a shutdown after a 200 went out (the line's
``error`` says which: ``error``, ``abort``, ``timeout``, ``shutdown``); ``complete`` otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from starlette.requests import ClientDisconnect
from starlette.routing import Match, Router
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferd.server.defaults import ACCESS_LOG_FORMATS
from inferd.server.limits import request_deadline
from inferd.server.metrics import TIMER_KEY, RequestTimer, ServerMetrics

ACCESS_LOGGER = "inferd.access"
LOG_FORMATS = ACCESS_LOG_FORMATS
UNMATCHED_ROUTE = "<unmatched>"
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})

access_log = logging.getLogger(ACCESS_LOGGER)


def route_pattern(router: Router, scope: Scope) -> str:
    """The path pattern of the route that serves ``scope`` (e.g. /v1/models/{model_id})."""
    partial: str | None = None
    for route in router.routes:
        path = getattr(route, "path", None)
        if not isinstance(path, str):
            continue
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return path
        if match is Match.PARTIAL and partial is None:
            partial = path  # right path, wrong method: answered 405
    return partial or UNMATCHED_ROUTE


class PayloadLog:
    """Request bodies as JSON lines, for debugging only (--log-payloads)."""

    def __init__(self, path: str | Path, max_bytes: int) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.close(fd)

    def write(self, record: dict[str, Any], body: bytes, truncated: bool) -> None:
        entry = {**record, "body": body.decode("utf-8", "replace"), "truncated": truncated}
        line = json.dumps(entry, ensure_ascii=False) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            f.write(line)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (test runners swap it)."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


def configure_access_logger() -> None:
    """Access lines go to stderr verbatim (one JSON object per line in json format)."""
    access_log.setLevel(logging.INFO)
    access_log.propagate = False
    if not any(isinstance(h, _StderrHandler) for h in access_log.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        access_log.addHandler(handler)


@dataclass(slots=True)
class _Exchange:
    """What the middleware saw of one request."""

    body_bytes: int = 0
    body: bytearray | None = None
    body_truncated: bool = False
    body_complete: bool = False
    status: int | None = None
    response_complete: bool = False
    disconnected: bool = False
    raised: bool = False


class AccessLogMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        router: Router,
        metrics: ServerMetrics | None = None,
        log_format: str | None = "text",
        payload_log: PayloadLog | None = None,
    ) -> None:
        if log_format is not None and log_format not in LOG_FORMATS:
            raise ValueError(f"access log format must be one of {', '.join(LOG_FORMATS)}")
        self.app = app
        self.router = router
        self.metrics = metrics
        self.log_format = log_format
        self.payload_log = payload_log
        if log_format is not None:
            configure_access_logger()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method = scope["method"] if scope["method"] in _METHODS else "OTHER"
        route = route_pattern(self.router, scope)
        state = scope.setdefault("state", {})
        request_id = str(state.get("request_id") or "-")
        timer = RequestTimer(metrics=self.metrics)
        state[TIMER_KEY] = timer
        seen = _Exchange(body=bytearray() if self.payload_log is not None else None)
        base = {"request_id": request_id, "method": method, "route": route}
        self._log("request_start", base)
        if self.metrics is not None:
            self.metrics.in_flight.inc()

        async def receive_observed() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                chunk = message.get("body", b"")
                seen.body_bytes += len(chunk)
                if seen.body is not None and self.payload_log is not None:
                    room = self.payload_log.max_bytes - len(seen.body)
                    seen.body += chunk[: max(room, 0)]
                    seen.body_truncated |= len(chunk) > room
                if not message.get("more_body", False):
                    seen.body_complete = True
            elif message["type"] == "http.disconnect" and not seen.response_complete:
                seen.disconnected = True
            return message

        async def send_observed(message: Message) -> None:
            if message["type"] == "http.response.start":
                seen.status = int(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                seen.response_complete = True
            try:
                await send(message)
            except OSError:
                seen.disconnected = True
                raise

        try:
            await self.app(scope, receive_observed, send_observed)
        except ClientDisconnect:
            seen.disconnected = True  # nobody is left to answer
        except BaseException:
            seen.raised = True
            raise
        finally:
            deadline = request_deadline(scope)
            timed_out = deadline is not None and deadline.expired
            self._finish(base, timer, seen, "timeout" if timed_out else timer.error)

    def _finish(
        self, base: dict[str, Any], timer: RequestTimer, seen: _Exchange, error: str | None
    ) -> None:
        """``error``: why generation failed, if it did ("timeout", "error", "abort")."""
        duration = time.perf_counter() - timer.started
        status = seen.status
        if status is None:
            status = 499 if seen.disconnected and not seen.raised else 500
        if seen.disconnected or status == 499:
            outcome = "client_disconnected"
        elif seen.raised or status >= 400 or not seen.response_complete or error:
            outcome = "error"
        else:
            outcome = "complete"
        if self.metrics is not None:
            m = self.metrics
            method, route = base["method"], base["route"]
            m.in_flight.dec()
            m.requests.labels(method, route, str(status)).inc()
            m.outcomes.labels(route, outcome).inc()
            m.duration.labels(method, route).observe(duration)
            if seen.body_bytes or method in ("POST", "PUT", "PATCH"):
                m.body_bytes.labels(method, route).observe(seen.body_bytes)
            if error == "timeout":
                m.timeouts.labels(route).inc()
        end = {
            **base,
            "status": status,
            "duration_ms": round(duration * 1000, 3),
            "model": timer.model,
            "prompt_tokens": timer.prompt_tokens,
            "completion_tokens": timer.completion_tokens,
            "outcome": outcome,
        }
        if error:
            end["error"] = error
        self._log("request_end", end)
        if self.payload_log is not None and seen.body is not None and seen.body_bytes:
            self.payload_log.write(base, bytes(seen.body), seen.body_truncated)

    def _log(self, event: str, fields: dict[str, Any]) -> None:
        if self.log_format is None or not access_log.isEnabledFor(logging.INFO):
            return
        ts = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        if self.log_format == "json":
            line = json.dumps({"ts": ts, "event": event, **fields}, separators=(",", ":"))
        else:
            parts = " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
            line = f"{ts} {event} {parts}"
        access_log.info(line)


def _text_value(value: Any) -> str:
    if value is None:
        return "-"
    text = str(value)
    if not text or any(c.isspace() or c in '"=' for c in text):
        return json.dumps(text)
    return text
