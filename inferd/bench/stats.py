"""Per-request timings and their summary (medians and tails, never single runs)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestTiming:
    started: float
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)  # arrival of each text delta
    tokens: int | None = None  # generated tokens as the engine counted them, when it says
    completed: bool = False
    # Speculative drafts the server says it verified and accepted (llama-server's timings)
    drafted: int | None = None
    accepted: int | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.started


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


@dataclass(frozen=True, slots=True)
class Summary:
    name: str
    engine: str
    requests: int
    incomplete: int
    output_tokens: int
    seconds: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    peak_rss_mb: float | None = None
    drafted: int | None = None  # speculative draft tokens verified, when the engine says
    accepted: int | None = None  # and how many of them it accepted

    @property
    def acceptance(self) -> float | None:
        """Accepted over drafted tokens (None: unknown, or nothing drafted)."""
        if not self.drafted or self.accepted is None:
            return None
        return self.accepted / self.drafted

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    @property
    def requests_per_second(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def summarize(
    name: str,
    engine: str,
    timings: list[RequestTiming],
    seconds: float,
    peak_rss_mb: float | None = None,
) -> Summary:
    ttfts = [t.ttft for t in timings if t.ttft is not None]
    drafts = [t for t in timings if t.drafted is not None]
    gaps = [b - a for t in timings for a, b in zip(t.token_times, t.token_times[1:], strict=False)]
    return Summary(
        name=name,
        engine=engine,
        requests=len(timings),
        incomplete=sum(1 for t in timings if not t.completed),
        output_tokens=sum(
            t.tokens if t.tokens is not None else len(t.token_times) for t in timings
        ),
        seconds=seconds,
        ttft_p50=statistics.median(ttfts) if ttfts else float("nan"),
        ttft_p99=percentile(ttfts, 99),
        itl_p50=statistics.median(gaps) if gaps else float("nan"),
        itl_p99=percentile(gaps, 99),
        peak_rss_mb=peak_rss_mb,
        drafted=sum(t.drafted or 0 for t in drafts) if drafts else None,
        accepted=sum(t.accepted or 0 for t in drafts) if drafts else None,
    )
