"""`inferd bench --in-process`: the engine swept on this thread, timed per token."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from inferd.bench.main import render
from inferd.bench.sweep import SweepPoint, peak_rss_mb, run_point, sweep_points
from inferd.config import EngineConfig
from inferd.engine.driver import CallerLoop
from inferd.serving.served import ServedModel, load_model
from inferd.source import resolve_source


@pytest.fixture(scope="module")
def served(smollm2_gguf: Path) -> Iterator[ServedModel]:
    """The default model with default settings, stepped by the sweep (this thread)."""
    source = resolve_source(str(smollm2_gguf))
    model = load_model(source, EngineConfig(), progress=False, loop=CallerLoop())
    yield model
    model.shutdown()


def test_the_sweep_varies_each_axis() -> None:
    points = sweep_points()
    prompts = {p.prompt_tokens for p in points if p.name.startswith("prompt")}
    lengths = {p.max_tokens for p in points if p.name.startswith("generate")}
    concurrency = {p.concurrency for p in points if p.name.startswith("concurrency")}
    assert max(prompts) >= 2000 and len(prompts) >= 3
    assert len(lengths) >= 3 and 16 in concurrency and 1 in concurrency


@pytest.mark.parametrize(
    "point",
    [SweepPoint("long prompt", 300, 4, 1, 2), SweepPoint("three at once", 24, 6, 3, 5)],
    ids=lambda p: p.name,
)
def test_a_point_times_every_token_of_every_request(served: ServedModel, point: SweepPoint) -> None:
    before = served.engine.stats()
    summary = run_point(served, point)
    after = served.engine.stats()
    assert summary.requests == point.requests and summary.incomplete == 0
    assert summary.output_tokens == point.requests * point.max_tokens  # ignore_eos: all of them
    # Every prompt had exactly the point's length, and all of it was computed.
    assert after.prompt_tokens - before.prompt_tokens == point.requests * point.prompt_tokens
    assert after.prefix_cache_hits == before.prefix_cache_hits
    assert after.running == after.waiting == 0
    assert 0 < summary.ttft_p50 <= summary.ttft_p99 < summary.seconds
    assert 0 < summary.itl_p50 <= summary.itl_p99
    assert summary.requests_per_second == pytest.approx(point.requests / summary.seconds)
    assert f"| {point.name} | inferd | " in render([summary], None)
    assert peak_rss_mb() > 100
