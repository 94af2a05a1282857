"""Drive any OpenAI-compatible server with concurrent streaming clients and time every token."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from inferd.bench.stats import RequestTiming, Summary, summarize
from inferd.bench.workloads import Workload


async def _one(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    workload: Workload,
    index: int,
    extra: dict[str, object],
) -> RequestTiming:
    request = workload.request(index)
    field, route = (
        ("prompt", "/completions") if workload.text else ("messages", "/chat/completions")
    )
    body = {
        "model": model,
        field: request,
        "max_tokens": workload.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    timing = RequestTiming(started=time.perf_counter())
    try:
        async with client.stream("POST", url + route, json=body) as resp:
            if resp.status_code != 200:
                return timing
            async for line in resp.aiter_lines():
                _consume(line, timing)
    except httpx.HTTPError:
        timing.completed = False
    return timing


def _consume(line: str, timing: RequestTiming) -> None:
    if not line.startswith("data: "):
        return
    data = line.removeprefix("data: ")
    if data == "[DONE]":
        # Servers that report no usage in streams (llama-cpp-python's) count by their deltas.
        timing.completed = timing.tokens is not None or bool(timing.token_times)
        return
    chunk = json.loads(data)
    if chunk.get("usage"):
        timing.tokens = chunk["usage"]["completion_tokens"]
    timings = chunk.get("timings") or {}
    if "draft_n" in timings:  # llama-server's speculation counts, in its last chunk
        timing.drafted = int(timings["draft_n"])
        timing.accepted = int(timings.get("draft_n_accepted", 0))
    for choice in chunk.get("choices", []):
        # Chat streams carry delta.content; completion streams carry text.
        if choice.get("delta", {}).get("content") or choice.get("text"):
            now = time.perf_counter()
            if timing.first_token is None:
                timing.first_token = now
            timing.token_times.append(now)


async def run_http(
    url: str,
    model: str,
    workload: Workload,
    engine: str = "inferd",
    extra: dict[str, object] | None = None,
) -> Summary:
    """Send ``workload.requests`` streams, at most ``workload.concurrency`` at a time."""
    gate = asyncio.Semaphore(workload.concurrency)
    limits = httpx.Limits(max_connections=workload.concurrency + 4)

    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def guarded(i: int) -> RequestTiming:
            async with gate:
                return await _one(client, url, model, workload, i, extra or {})

        started = time.perf_counter()
        timings = await asyncio.gather(*(guarded(i) for i in range(workload.requests)))
        elapsed = time.perf_counter() - started
    return summarize(workload.name, engine, list(timings), elapsed)
