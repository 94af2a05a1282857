"""Prometheus metrics: a small registry, per-request timing hooks, and the /metrics handler.

No ``prometheus_client`` dependency: the text exposition format is simple and the server needs
only counters, gauges and histograms, all updated on the event loop (so no locks).

Handlers observe generation through a ``RequestTimer``, which the access-log middleware puts
in the request scope::

    outputs = request_timer(request).watch(model.engine.generate(...), model.id)

``watch`` passes every ``RequestOutput`` through unchanged while it records time to first
token, inter-token latency and token counts, and enforces the request deadline set by
``--request-timeout``: when it passes, the engine request is aborted (its KV blocks freed) and
``RequestTimeoutError`` is raised for the limits middleware to answer.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from inferd.engine.outputs import RequestOutput
from inferd.version import __version__

if TYPE_CHECKING:
    from inferd.server.state import ServerState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TIMER_KEY = "inferd_timer"

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
BYTES_BUCKETS = (256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)

Labels = tuple[str, ...]


# -- registry -------------------------------------------------------------------------------
class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.labelnames = tuple(labelnames)

    def _key(self, labels: Sequence[str]) -> Labels:
        if len(labels) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {tuple(labels)}")
        return tuple(labels)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def samples(self) -> Iterable[str]:
        raise NotImplementedError

    def _labels(self, values: Labels, extra: tuple[tuple[str, str], ...] = ()) -> str:
        pairs = [*zip(self.labelnames, values, strict=True), *extra]
        if not pairs:
            return ""
        return "{" + ",".join(f'{k}="{escape_label(v)}"' for k, v in pairs) + "}"


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labelnames)
        self.values: dict[Labels, float] = {}

    def inc(self, amount: float = 1.0, labels: Sequence[str] = ()) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        key = self._key(labels)
        self.values[key] = self.values.get(key, 0.0) + amount

    def samples(self) -> Iterable[str]:
        for key, value in sorted(self.values.items()):
            yield f"{self.name}{self._labels(key)} {format_value(value)}"


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labelnames)
        self.values: dict[Labels, float] = {} if labelnames else {(): 0.0}

    def set(self, value: float, labels: Sequence[str] = ()) -> None:
        self.values[self._key(labels)] = value

    def inc(self, amount: float = 1.0, labels: Sequence[str] = ()) -> None:
        key = self._key(labels)
        self.values[key] = self.values.get(key, 0.0) + amount

    def dec(self, amount: float = 1.0, labels: Sequence[str] = ()) -> None:
        self.inc(-amount, labels)

    def samples(self) -> Iterable[str]:
        for key, value in sorted(self.values.items()):
            yield f"{self.name}{self._labels(key)} {format_value(value)}"


@dataclass(slots=True)
class _HistogramSeries:
    counts: list[int]  # per bucket, not cumulative; the last one is +Inf
    sum: float = 0.0
    count: int = 0


class Histogram(_Metric):
    kind = "histogram"

    def __init__(
        self, name: str, help_text: str, labelnames: Sequence[str], buckets: Sequence[float]
    ) -> None:
        super().__init__(name, help_text, labelnames)
        if list(buckets) != sorted(set(buckets)) or not buckets:
            raise ValueError("histogram buckets must be distinct and increasing")
        self.buckets = tuple(float(b) for b in buckets)
        self.series: dict[Labels, _HistogramSeries] = {}

    def observe(self, value: float, labels: Sequence[str] = (), count: int = 1) -> None:
        """Record ``count`` observations of ``value``."""
        if count <= 0 or math.isnan(value):
            return
        key = self._key(labels)
        series = self.series.get(key)
        if series is None:
            series = self.series[key] = _HistogramSeries([0] * (len(self.buckets) + 1))
        index = len(self.buckets)
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                index = i
                break
        series.counts[index] += count
        series.sum += value * count
        series.count += count

    def samples(self) -> Iterable[str]:
        for key, series in sorted(self.series.items()):
            running = 0
            for bound, n in zip((*self.buckets, math.inf), series.counts, strict=True):
                running += n
                le = (("le", format_value(bound)),)
                yield f"{self.name}_bucket{self._labels(key, le)} {running}"
            yield f"{self.name}_sum{self._labels(key)} {format_value(series.sum)}"
            yield f"{self.name}_count{self._labels(key)} {series.count}"


_M = TypeVar("_M", bound=_Metric)


class Registry:
    def __init__(self) -> None:
        self.metrics: list[_Metric] = []

    def add(self, metric: _M) -> _M:
        if any(m.name == metric.name for m in self.metrics):
            raise ValueError(f"metric {metric.name} is already registered")
        self.metrics.append(metric)
        return metric

    def render(self) -> list[str]:
        lines: list[str] = []
        for metric in self.metrics:
            lines += metric.header()
            lines += metric.samples()
        return lines


def escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


# -- the server's series ----------------------------------------------------------------------
class ServerMetrics:
    """Every series the HTTP layer records; engine series are read from ``stats()`` on scrape."""

    def __init__(self) -> None:
        r = self.registry = Registry()
        self.info = r.add(Gauge("inferd_build_info", "inferd version.", ["version"]))
        self.info.set(1, [__version__])
        self.requests = r.add(
            Counter(
                "inferd_http_requests_total",
                "HTTP requests answered, by route pattern and status.",
                ["method", "route", "status"],
            )
        )
        self.outcomes = r.add(
            Counter(
                "inferd_http_request_outcomes_total",
                "HTTP requests by outcome: complete, client_disconnected or error.",
                ["route", "outcome"],
            )
        )
        self.duration = r.add(
            Histogram(
                "inferd_http_request_duration_seconds",
                "Time from request start to the end of the response.",
                ["method", "route"],
                DURATION_BUCKETS,
            )
        )
        self.in_flight = r.add(
            Gauge("inferd_http_requests_in_flight", "HTTP requests being answered now.")
        )
        self.body_bytes = r.add(
            Histogram(
                "inferd_http_request_body_bytes",
                "Request body sizes in bytes.",
                ["method", "route"],
                BYTES_BUCKETS,
            )
        )
        self.ttft = r.add(
            Histogram(
                "inferd_time_to_first_token_seconds",
                "Time from request start to the first generated token.",
                ["model"],
                TTFT_BUCKETS,
            )
        )
        self.itl = r.add(
            Histogram(
                "inferd_inter_token_latency_seconds",
                "Time between generated tokens of one request.",
                ["model"],
                ITL_BUCKETS,
            )
        )
        self.tokens_in = r.add(
            Counter(
                "inferd_request_prompt_tokens_total",
                "Prompt tokens of requests that finished generating.",
                ["model"],
            )
        )
        self.tokens_out = r.add(
            Counter(
                "inferd_request_generation_tokens_total",
                "Tokens generated for requests, counted as they are delivered.",
                ["model"],
            )
        )
        self.timeouts = r.add(
            Counter(
                "inferd_request_timeouts_total",
                "Requests stopped by --request-timeout.",
                ["route"],
            )
        )

    def render(self, state: ServerState | None) -> str:
        lines = self.registry.render()
        if state is not None:
            lines += engine_lines(state)
        return "\n".join(lines) + "\n"


# (metric name, EngineStats field, type, help). Fields an engine does not report read as 0.
ENGINE_SERIES = (
    ("inferd_requests_running", "running", "gauge", "Requests being computed."),
    ("inferd_requests_waiting", "waiting", "gauge", "Requests queued for admission."),
    ("inferd_kv_blocks_used", "kv_blocks_used", "gauge", "KV-cache blocks held by requests."),
    ("inferd_kv_blocks_total", "kv_blocks_total", "gauge", "KV-cache blocks in the pool."),
    ("inferd_preemptions_total", "preemptions", "counter", "Requests preempted for KV space."),
    ("inferd_prompt_tokens_total", "prompt_tokens", "counter", "Prompt tokens admitted."),
    ("inferd_generation_tokens_total", "generated_tokens", "counter", "Tokens generated."),
    ("inferd_engine_steps_total", "steps", "counter", "Engine steps run."),
    (
        "inferd_prefix_cache_hits_total",
        "prefix_cache_hits",
        "counter",
        "Prompt tokens served from the prefix cache.",
    ),
    (
        "inferd_prefix_cache_queries_total",
        "prefix_cache_queries",
        "counter",
        "Prompt tokens looked up in the prefix cache.",
    ),
)


def engine_lines(state: ServerState) -> list[str]:
    stats = {name: m.engine.stats() for name, m in state.models.items()}
    lines: list[str] = []
    for metric, attr, kind, help_text in ENGINE_SERIES:
        lines.append(f"# HELP {metric} {help_text}")
        lines.append(f"# TYPE {metric} {kind}")
        for model, s in sorted(stats.items()):
            value = getattr(s, attr, 0) or 0
            lines.append(f'{metric}{{model="{escape_label(model)}"}} {format_value(value)}')
    return lines


async def metrics(request: Request) -> Response:
    """GET /metrics in the Prometheus text format."""
    state: ServerState = request.app.state.inferd
    server_metrics: ServerMetrics | None = getattr(request.app.state, "server_metrics", None)
    if server_metrics is None:
        body = "\n".join(engine_lines(state)) + "\n"
    else:
        body = server_metrics.render(state)
    return PlainTextResponse(body, media_type=CONTENT_TYPE)


# -- per-request hooks ------------------------------------------------------------------------
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
class RequestTimer:
    """What one HTTP request did: timings, token counts and how generation ended.

    Created by the access-log middleware (``metrics`` is None when /metrics is off); handlers
    get it with ``request_timer(request)``. ``deadline`` is an event-loop time, set by the
    limits middleware when --request-timeout is on.
    """

    metrics: ServerMetrics | None = None
    started: float = field(default_factory=time.perf_counter)
    deadline: float | None = None
    timeout: float | None = None
    model: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    first_token_at: float | None = None
    error: str | None = None  # why generation failed ("timeout", "error", "abort")

    def watch(
        self, outputs: AsyncIterator[RequestOutput], model: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Pass ``outputs`` through, observing it. Call once per engine stream (n > 1: n times)."""
        if model is not None:
            self.model = model
        return self._watch(outputs)

    async def _watch(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        model = self.model or ""
        seen_tokens = 0
        last_token_at: float | None = None
        counted_prompt = False
        try:
            while True:
                try:
                    out = await self._next(outputs)
                except StopAsyncIteration:
                    return
                now = time.perf_counter()
                new_tokens = out.num_output_tokens - seen_tokens
                if new_tokens > 0:
                    seen_tokens = out.num_output_tokens
                    self.completion_tokens = (self.completion_tokens or 0) + new_tokens
                    self._observe_tokens(model, now, last_token_at, new_tokens)
                    last_token_at = now
                if out.finished:
                    if not counted_prompt:
                        counted_prompt = True
                        self.prompt_tokens = (self.prompt_tokens or 0) + out.num_prompt_tokens
                        if self.metrics is not None:
                            self.metrics.tokens_in.inc(out.num_prompt_tokens, [model])
                    if out.finish_reason in ("error", "abort"):
                        self.error = out.finish_reason
                yield out
        finally:
            await _close(outputs)  # leaving early (timeout, client gone) aborts the request

    def _observe_tokens(
        self, model: str, now: float, last_token_at: float | None, new_tokens: int
    ) -> None:
        if self.first_token_at is None:
            self.first_token_at = now
            new_tokens -= 1
            if self.metrics is not None:
                self.metrics.ttft.observe(now - self.started, [model])
                self.metrics.tokens_out.inc(1, [model])
        if self.metrics is None or new_tokens <= 0:
            return
        self.metrics.tokens_out.inc(new_tokens, [model])
        if last_token_at is not None:
            # Tokens that arrive together share the gap since the previous delivery.
            self.metrics.itl.observe((now - last_token_at) / new_tokens, [model], count=new_tokens)

    async def _next(self, outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
        if self.deadline is None:
            return await outputs.__anext__()
        try:
            async with asyncio.timeout_at(self.deadline):
                return await outputs.__anext__()
        except TimeoutError:
            self.error = "timeout"
            raise RequestTimeoutError(self.timeout or 0.0) from None


async def _close(outputs: AsyncIterator[RequestOutput]) -> None:
    """Close an engine stream: an async generator (aclose) or a RequestStream (close)."""
    aclose = getattr(outputs, "aclose", None)
    if aclose is not None:
        await aclose()
        return
    close = getattr(outputs, "close", None)
    if close is not None:
        close()


def request_timer(request: Request) -> RequestTimer:
    """The request's timer; a detached one (recording nothing) outside the middleware."""
    state: dict[str, Any] = request.scope.setdefault("state", {})
    timer = state.get(TIMER_KEY)
    if not isinstance(timer, RequestTimer):
        timer = state[TIMER_KEY] = RequestTimer()
    return timer
