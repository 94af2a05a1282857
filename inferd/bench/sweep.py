"""In-process sweeps of the engine: prompt length, generation length, concurrency.

No HTTP and no engine thread: the synchronous engine is stepped on this thread (the main thread, as
under `inferd serve`), requests are admitted up to the point's concurrency, and every generated
token is timed as the step that made it returns. The same figures as the HTTP workloads come out
(TTFT and inter-token latency p50/p99, output tokens/s, requests/s), plus the process's peak RSS.
"""

from __future__ import annotations

import resource
import time
import uuid
from dataclasses import dataclass

from inferd.bench.stats import RequestTiming, Summary, summarize
from inferd.engine.sampling import SamplingParams
from inferd.serving.served import ServedModel

FILLER = "The keeper climbed the stairs, trimmed the wick and wound the clockwork. "


@dataclass(frozen=True, slots=True)
class SweepPoint:
    name: str
    prompt_tokens: int
    max_tokens: int
    concurrency: int
    requests: int


def sweep_points() -> list[SweepPoint]:
    """Each axis varied alone around a short prompt, 64 new tokens, one request at a time."""
    points = [SweepPoint(f"prompt {n}", n, 16, 1, 2) for n in (32, 256, 1024, 2048)]
    points += [SweepPoint(f"generate {n}", 32, n, 1, 2) for n in (16, 64, 256)]
    points += [SweepPoint(f"concurrency {c}", 32, 64, c, 2 * c) for c in (1, 4, 16, 32)]
    return points


def run_point(served: ServedModel, point: SweepPoint) -> Summary:
    """Run one point on ``served``'s engine, which must be stepped by its caller (CallerLoop)."""
    engine = served.engine.engine
    text_ids = served.tokenizer.encode(FILLER * (point.prompt_tokens // 8 + 1))
    params = SamplingParams(max_tokens=point.max_tokens, temperature=0, ignore_eos=True)
    prompt = text_ids[: point.prompt_tokens]
    pending = point.requests
    timings: dict[str, RequestTiming] = {}
    started = time.perf_counter()
    running = 0
    while pending or running:
        while pending and running < point.concurrency:
            rid = f"sweep-{uuid.uuid4().hex}"
            # Its own cache salt: every prompt is computed, never found in the prefix cache.
            engine.add_request(rid, prompt, params, cache_salt=rid)
            pending -= 1
            timings[rid] = RequestTiming(started=time.perf_counter())
            running += 1
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            timing = timings[out.request_id]
            _record_tokens(timing, len(out.token_ids), now)
            if out.finished:
                timing.tokens = out.num_output_tokens
                timing.completed = out.finish_reason == "length"
                running -= 1
    return summarize(point.name, "inferd", list(timings.values()), time.perf_counter() - started)


def _record_tokens(timing: RequestTiming, count: int, now: float) -> None:
    """``count`` tokens that arrived together at ``now``. A step that verified speculative
    drafts emits several: they are spread evenly over the time since the previous token, so
    the inter-token latency is what a reader of the stream waits per token on average, not a
    gap of zero between tokens computed in one step."""
    if count == 0:
        return
    last = timing.token_times[-1] if timing.token_times else None
    timing.first_token = timing.first_token or now
    for i in range(1, count + 1):
        timing.token_times.append(now if last is None else last + (now - last) * i / count)


def peak_rss_mb() -> float:
    """This process's peak resident memory (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
