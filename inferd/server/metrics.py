"""Prometheus metrics through ``prometheus_client``: the server's series, per-request timing
hooks, and the /metrics handler.

Each app has its own ``CollectorRegistry``, so two apps in one process (two mounts, tests)
count apart. When ``PROMETHEUS_MULTIPROC_DIR`` is set in the environment before the process
starts (several worker processes behind one port), the HTTP series are written to that
directory and /metrics sums every process's through prometheus_client's
``MultiProcessCollector`` (a supervisor should call ``multiprocess.mark_process_dead`` for a
worker that exits, or its in-flight gauge stays in the sum). The engine series are read from
``stats()`` of this process's engines on each scrape.

Handlers observe generation through a ``RequestTimer``, which the access-log middleware puts
in the request scope (``generation.start`` wraps every engine stream in it)::

    outputs = request_timer(request).watch(model.engine.generate(...), model.id)

``watch`` passes every ``RequestOutput`` through unchanged while it records time to first
token, inter-token latency and token counts. The request deadline is not its business (see
limits.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Scope

from inferd.server.streams import close_stream
from inferd.serving.interface import RequestOutput
from inferd.version import __version__

if TYPE_CHECKING:
    from inferd.server.state import ServerState

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
TIMER_KEY = "inferd_timer"

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
BYTES_BUCKETS = (256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)


class ServerMetrics:
    """Every series the HTTP layer records, in this app's registry, plus the engine series of
    ``state``'s models, read on scrape."""

    def __init__(self, state: ServerState) -> None:
        self.registry = CollectorRegistry()
        if os.environ.get(MULTIPROC_DIR_ENV):
            # Values live in the directory's files; the registry reads every process's back.
            MultiProcessCollector(self.registry)
            into: CollectorRegistry | None = None
        else:
            into = self.registry
        self.info = Gauge(
            "inferd_build_info",
            "inferd version.",
            ["version"],
            registry=into,
            multiprocess_mode="max",
        )
        self.info.labels(__version__).set(1)
        self.requests = Counter(
            "inferd_http_requests_total",
            "HTTP requests answered, by route pattern and status.",
            ["method", "route", "status"],
            registry=into,
        )
        self.outcomes = Counter(
            "inferd_http_request_outcomes_total",
            "HTTP requests by outcome: complete, client_disconnected or error.",
            ["route", "outcome"],
            registry=into,
        )
        self.duration = Histogram(
            "inferd_http_request_duration_seconds",
            "Time from request start to the end of the response.",
            ["method", "route"],
            buckets=DURATION_BUCKETS,
            registry=into,
        )
        self.in_flight = Gauge(
            "inferd_http_requests_in_flight",
            "HTTP requests being answered now.",
            registry=into,
            multiprocess_mode="livesum",
        )
        self.body_bytes = Histogram(
            "inferd_http_request_body_bytes",
            "Request body sizes in bytes.",
            ["method", "route"],
            buckets=BYTES_BUCKETS,
            registry=into,
        )
        self.ttft = Histogram(
            "inferd_time_to_first_token_seconds",
            "Time from request start to the first generated token.",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=into,
        )
        self.itl = Histogram(
            "inferd_inter_token_latency_seconds",
            "Time between generated tokens of one request.",
            ["model"],
            buckets=ITL_BUCKETS,
            registry=into,
        )
        self.tokens_in = Counter(
            "inferd_request_prompt_tokens_total",
            "Prompt tokens of requests that started generating.",
            ["model"],
            registry=into,
        )
        self.tokens_out = Counter(
            "inferd_request_generation_tokens_total",
            "Tokens generated for requests, counted as they are delivered.",
            ["model"],
            registry=into,
        )
        self.timeouts = Counter(
            "inferd_request_timeouts_total",
            "Requests stopped by --request-timeout.",
            ["route"],
            registry=into,
        )
        self.registry.register(EngineCollector(state))  # after the HTTP series, on scrape too

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


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
    (
        "inferd_prefix_cache_entries",
        "prefix_cache_entries",
        "gauge",
        "Cached prompt prefixes kept (chains of cached blocks no request holds; "
        "--prefix-cache-n bounds them).",
    ),
    ("inferd_images_encoded_total", "images_encoded", "counter", "Images run through an encoder."),
    (
        "inferd_encoder_cache_hits_total",
        "encoder_cache_hits",
        "counter",
        "Images whose encoder output came from the encoder cache.",
    ),
    (
        "inferd_speculative_draft_tokens_total",
        "speculative_drafted",
        "counter",
        "Drafted tokens verified by speculative decoding.",
    ),
    (
        "inferd_speculative_accepted_tokens_total",
        "speculative_accepted",
        "counter",
        "Drafted tokens the model accepted.",
    ),
    ("inferd_lora_resident", "lora_resident", "gauge", "LoRA adapters attached now."),
    (
        "inferd_lora_loads_total",
        "lora_loads",
        "counter",
        "LoRA adapters loaded into a slot (--max-loras), after an eviction too.",
    ),
    (
        "inferd_lora_evictions_total",
        "lora_evictions",
        "counter",
        "LoRA adapters evicted (least recently used, idle) to free a slot.",
    ),
)


class EngineCollector(Collector):
    """The engine series of the loaded models, from their ``stats()`` at scrape time."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        stats = {name: m.engine.stats() for name, m in sorted(self.state.models.items())}
        for name, attr, kind, help_text in ENGINE_SERIES:
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            metric = family(name, help_text, labels=["model"])
            for model, s in stats.items():
                metric.add_metric([model], getattr(s, attr, 0) or 0)
            yield metric
        yield self._kv_capacity()
        yield self._weights()

    def _kv_capacity(self) -> Metric:
        """The pool's size in tokens, labelled with how it stores them (--kv-cache-dtype)."""
        metric = GaugeMetricFamily(
            "inferd_kv_cache_capacity_tokens",
            "Tokens the KV-cache pool holds, by the dtype it stores keys and values in.",
            labels=["model", "dtype"],
        )
        for name, model in sorted(self.state.models.items()):
            tokens = getattr(model, "kv_cache_tokens", None)
            if tokens is not None:
                metric.add_metric([name, getattr(model, "kv_cache_dtype", "")], tokens)
        return metric

    def _weights(self) -> Metric:
        """The RAM each model's weights take, labelled with its in-situ quantization: both
        change when it is re-quantized (POST /re_isq)."""
        metric = GaugeMetricFamily(
            "inferd_model_weight_bytes",
            "Bytes the model's weights take in RAM (packed copies included), by its ISQ method.",
            labels=["model", "isq"],
        )
        for name, model in sorted(self.state.models.items()):
            metric.add_metric([name, model.isq or "none"], model.weight_bytes)
        return metric

    def describe(self) -> Iterator[Metric]:
        return iter(())  # the models change at run time: collected, never described


async def metrics(request: Request) -> Response:
    """GET /metrics in the Prometheus text format."""
    server_metrics: ServerMetrics = request.app.state.server_metrics
    return Response(server_metrics.exposition(), media_type=CONTENT_TYPE_PLAIN_0_0_4)


# -- per-request hooks ------------------------------------------------------------------------
@dataclass(slots=True)
class RequestTimer:
    """What one HTTP request did: timings, token counts and how generation ended.

    Created by the access-log middleware (``metrics`` is None when /metrics is off); handlers
    get it with ``request_timer(request)``.
    """

    metrics: ServerMetrics | None = None
    started: float = field(default_factory=time.perf_counter)
    model: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    first_token_at: float | None = None
    error: str | None = None  # why generation failed ("error", "abort")
    # An OpenAI-style stream whose caller asked for usage: its usage chunk for a count of
    # output tokens. A middleware that cuts the stream (a shutdown) cancels the handler and
    # writes the last event itself; this lets it say what was generated (``usage_so_far``).
    usage_chunk: Callable[[int], dict[str, Any]] | None = None

    def usage_so_far(self) -> dict[str, Any] | None:
        """The usage of a stream cut now, counting the output tokens this timer saw (the
        access log's figure); None when its caller asked for no usage."""
        if self.usage_chunk is None:
            return None
        usage: dict[str, Any] = self.usage_chunk(self.completion_tokens or 0)["usage"]
        return usage

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
            async for out in outputs:
                now = time.perf_counter()
                new_tokens = out.num_output_tokens - seen_tokens
                if new_tokens > 0:
                    seen_tokens = out.num_output_tokens
                    self.completion_tokens = (self.completion_tokens or 0) + new_tokens
                    self._observe_tokens(model, now, last_token_at, new_tokens)
                    last_token_at = now
                if not counted_prompt:  # at the first output: a run cut short has it too
                    counted_prompt = True
                    self.prompt_tokens = (self.prompt_tokens or 0) + out.num_prompt_tokens
                    if self.metrics is not None:
                        self.metrics.tokens_in.labels(model).inc(out.num_prompt_tokens)
                if out.finished and out.finish_reason in ("error", "abort"):
                    self.error = out.finish_reason
                yield out
        finally:
            await close_stream(outputs)  # leaving early (timeout, client gone) aborts it

    def _observe_tokens(
        self, model: str, now: float, last_token_at: float | None, new_tokens: int
    ) -> None:
        if self.first_token_at is None:
            self.first_token_at = now
            new_tokens -= 1
            if self.metrics is not None:
                self.metrics.ttft.labels(model).observe(now - self.started)
                self.metrics.tokens_out.labels(model).inc(1)
        if self.metrics is None or new_tokens <= 0:
            return
        self.metrics.tokens_out.labels(model).inc(new_tokens)
        if last_token_at is not None:
            # Tokens that arrive together share the gap since the previous delivery.
            gap = (now - last_token_at) / new_tokens
            itl = self.metrics.itl.labels(model)
            for _ in range(new_tokens):
                itl.observe(gap)


def cut_usage(scope: Scope) -> dict[str, Any] | None:
    """The usage of the stream a middleware cuts (``RequestTimer.usage_so_far``), if any."""
    timer = (scope.get("state") or {}).get(TIMER_KEY)
    return timer.usage_so_far() if isinstance(timer, RequestTimer) else None


def request_timer(request: Request) -> RequestTimer:
    """The request's timer; a detached one (recording nothing) outside the middleware."""
    state: dict[str, Any] = request.scope.setdefault("state", {})
    timer = state.get(TIMER_KEY)
    if not isinstance(timer, RequestTimer):
        timer = state[TIMER_KEY] = RequestTimer()
    return timer
