"""`inferd bench --speculative`: speculative decoding on and off, inferd beside llama-server.

Four servers on the same GGUF, all up for the whole run: inferd with ``--speculative off`` and
with ``ngram`` (prompt lookup), and llama.cpp's ``llama-server`` without speculation and with
``--spec-type ngram-simple``. Every round runs each workload (spec_workloads.py) at each stream
count on the four back to back, so load drifting on the machine hits all of them; the table
gives the median output tokens/s over rounds, the speed-up of speculation over each engine's
own off, inferd's n-gram over llama-server's, and the share of drafted tokens accepted (inferd's
from its /metrics counters, llama-server's from the ``timings`` of its last stream chunk).

A server that cannot start (no llama-server here) is reported unavailable; the rest still run.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from inferd.bench.http import run_http
from inferd.bench.process import start_server
from inferd.bench.server_peers import start_peer_server
from inferd.bench.stats import Summary
from inferd.bench.workloads import Workload

LLAMA_NGRAM = ("--spec-type", "ngram-simple")
DRAFTED = "inferd_speculative_draft_tokens_total"
ACCEPTED = "inferd_speculative_accepted_tokens_total"


@dataclass(frozen=True, slots=True)
class Setting:
    engine: str  # "inferd" | "llama-server"
    speculative: bool

    @property
    def label(self) -> str:
        if self.engine == "inferd":
            return "inferd ngram" if self.speculative else "inferd off"
        return "llama-server ngram-simple" if self.speculative else "llama-server off"


SETTINGS = (
    Setting("inferd", False),
    Setting("inferd", True),
    Setting("llama-server", False),
    Setting("llama-server", True),
)


@dataclass(frozen=True, slots=True)
class Endpoint:
    api: str  # OpenAI base URL, with /v1
    metrics: str | None = None  # inferd's /metrics: its speculation counters


@dataclass(slots=True)
class Comparison:
    workloads: list[Workload]
    runs: dict[tuple[str, str], list[Summary]] = field(default_factory=dict)  # (name, label)
    unavailable: dict[str, str] = field(default_factory=dict)  # label -> why

    def add(self, workload: Workload, setting: Setting, summary: Summary) -> None:
        self.runs.setdefault((workload.name, setting.label), []).append(summary)

    def median_tps(self, workload: Workload, setting: Setting) -> float | None:
        runs = self.runs.get((workload.name, setting.label))
        return statistics.median(r.tokens_per_second for r in runs) if runs else None

    def acceptance(self, workload: Workload, setting: Setting) -> float | None:
        """Accepted over drafted tokens, all rounds together (None: unknown or none drafted)."""
        runs = [r for r in self.runs.get((workload.name, setting.label), []) if r.drafted]
        drafted = sum(r.drafted or 0 for r in runs)
        return sum(r.accepted or 0 for r in runs) / drafted if drafted else None

    def incomplete(self) -> int:
        return sum(r.incomplete for runs in self.runs.values() for r in runs)


# Starts one setting's server; yields its endpoint. Raises when it cannot (peer missing).
Starter = Callable[[Setting, Path], AbstractContextManager[Endpoint]]


def server_starter(gguf: Path, threads: int, serve_extra: Sequence[str]) -> Starter:
    """Starting each setting's server on ``gguf``: inferd with ``serve_extra`` and the setting's
    ``--speculative`` (last, so it wins), llama-server with ``threads``."""

    @contextmanager
    def start(setting: Setting, log: Path) -> Iterator[Endpoint]:
        if setting.engine == "inferd":
            method = "ngram" if setting.speculative else "off"
            with start_server(gguf, [*serve_extra, "--speculative", method], log) as server:
                yield Endpoint(server.api, server.api.removesuffix("/v1") + "/metrics")
            return
        extra = LLAMA_NGRAM if setting.speculative else ()
        with start_peer_server(setting.engine, gguf, threads, log, extra=extra) as api:
            yield Endpoint(api)

    return start


def compare(
    starter: Starter,
    workloads: list[Workload],
    rounds: int,
    settings: Sequence[Setting] = SETTINGS,
    progress: Callable[[str], None] | None = None,
) -> Comparison:
    """Every round: each workload on each available setting, back to back."""
    result = Comparison(workloads)
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        endpoints: dict[Setting, Endpoint] = {}
        for setting in settings:
            log = Path(tmp) / f"{setting.label.replace(' ', '-')}.log"
            try:
                endpoints[setting] = stack.enter_context(starter(setting, log))
            except Exception as exc:  # a missing or broken peer must not sink the run
                if setting.engine == "inferd":
                    raise
                result.unavailable[setting.label] = f"{type(exc).__name__}: {exc}"[:300]
        for endpoint in endpoints.values():  # first requests pay for lazy set-up: not timed
            asyncio.run(run_http(endpoint.api, "default", Workload("warm-up", 1, 1, 4)))
        for r in range(rounds):
            for workload in workloads:
                for setting, endpoint in endpoints.items():
                    summary = measure(endpoint, workload, setting.label)
                    result.add(workload, setting, summary)
                    if progress is not None:  # each figure as it comes: a cut run keeps them
                        progress(
                            f"round {r + 1}/{rounds}: {workload.name}, {setting.label}: "
                            f"{summary.tokens_per_second:.1f} tokens/s, "
                            f"drafted {summary.drafted}, accepted {summary.accepted}"
                        )
    return result


def measure(endpoint: Endpoint, workload: Workload, label: str) -> Summary:
    """One run of ``workload``; with inferd's speculation counters when it has /metrics."""
    if endpoint.metrics is None:
        return asyncio.run(run_http(endpoint.api, "default", workload, label))
    before = speculation_counters(endpoint.metrics)
    summary = asyncio.run(run_http(endpoint.api, "default", workload, label))
    after = speculation_counters(endpoint.metrics)
    return replace(summary, drafted=after[0] - before[0], accepted=after[1] - before[1])


def speculation_counters(metrics_url: str) -> tuple[int, int]:
    """inferd's (drafted, accepted) token counters, summed over its models."""
    return parse_counters(httpx.get(metrics_url, timeout=30).text)


def parse_counters(exposition: str) -> tuple[int, int]:
    totals = {DRAFTED: 0.0, ACCEPTED: 0.0}
    for line in exposition.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return int(totals[DRAFTED]), int(totals[ACCEPTED])


def render(result: Comparison) -> str:
    """One row per workload: each setting's median tokens/s, the ratios, the acceptance."""
    off_i, on_i, off_l, on_l = SETTINGS
    lines = [
        f"| workload | {off_i.label} | {on_i.label} | vs off | accepted | {off_l.label} | "
        f"{on_l.label} | vs off | accepted | inferd ngram / llama-server ngram |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w in result.workloads:
        tps = {s: result.median_tps(w, s) for s in SETTINGS}
        cells = [
            _tps(tps[off_i], off_i, result),
            _tps(tps[on_i], on_i, result),
            _ratio(tps[on_i], tps[off_i]),
            _share(result.acceptance(w, on_i)),
            _tps(tps[off_l], off_l, result),
            _tps(tps[on_l], on_l, result),
            _ratio(tps[on_l], tps[off_l]),
            _share(result.acceptance(w, on_l)),
            _ratio(tps[on_i], tps[on_l]),
        ]
        lines.append(f"| {w.name} | " + " | ".join(cells) + " |")
    for label, why in result.unavailable.items():
        lines.append(f"\n{label}: unavailable ({why})")
    if result.incomplete():
        lines.append(f"\nincomplete requests (not counted as tokens): {result.incomplete()}")
    return "\n".join(lines)


def _tps(value: float | None, setting: Setting, result: Comparison) -> str:
    if value is None:
        return "unavailable" if setting.label in result.unavailable else "n/a"
    return f"{value:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "n/a"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def log_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
