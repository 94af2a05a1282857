"""`inferd bench --speculative`: its workloads, arguments, counters, table, and a short real run
of inferd's side (llama-server made absent, so it must be reported, not crash the run)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from inferd.bench.http import _consume
from inferd.bench.main import add_bench_args, spec_workloads
from inferd.bench.spec_compare import (
    SETTINGS,
    Comparison,
    compare,
    parse_counters,
    render,
    server_starter,
)
from inferd.bench.spec_workloads import LIGHTHOUSE, MAX_TOKENS, spec_workload
from inferd.bench.stats import RequestTiming, Summary, summarize

INFERD_OFF, INFERD_NGRAM, LLAMA_OFF, LLAMA_NGRAM = SETTINGS


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    return parser.parse_args(["--speculative", *argv])


def user_texts(kind: str, streams: int) -> list[str]:
    w = spec_workload(kind, streams)
    return [w.messages(i)[-1]["content"] for i in range(w.requests)]


def test_copy_prompts_hold_the_whole_passage_and_differ_per_stream() -> None:
    texts = user_texts("copy", 16)
    assert len(set(texts)) == 16  # no two streams share a whole prompt
    for text in texts:
        assert all(sentence in text for sentence in LIGHTHOUSE)
    assert texts[0].startswith("Repeat the following text exactly")
    one = spec_workload("copy", 1)
    assert (one.requests, one.concurrency, one.max_tokens) == (2, 1, MAX_TOKENS["copy"])


def test_summaries_get_a_longer_passage_and_free_gets_stories() -> None:
    summary, copy = user_texts("summarize", 1)[0], user_texts("copy", 1)[0]
    assert len(summary) > 1.8 * len(copy) and summary.startswith("Summarize")
    free = user_texts("free", 16)
    assert all("story" in text for text in free) and len(set(free)) == 16
    assert spec_workload("free", 16, max_tokens=7).max_tokens == 7
    with pytest.raises(ValueError, match="copy, summarize, free"):
        spec_workload("poetry", 1)


def test_arguments_choose_workloads_and_stream_counts() -> None:
    chosen = spec_workloads(bench_args("--workloads", "copy,free", "--streams", "1,16"))
    assert [w.name for w in chosen] == [
        "copy, 1 stream",
        "copy, 16 streams",
        "free, 1 stream",
        "free, 16 streams",
    ]
    assert [w.concurrency for w in chosen] == [1, 16, 1, 16]
    assert len(spec_workloads(bench_args())) == 6  # three kinds at 1 and 16 streams
    short = spec_workloads(bench_args("--max-tokens", "9"), text=True)
    assert all(w.max_tokens == 9 and w.text for w in short)
    with pytest.raises(ValueError, match="unknown --speculative workloads: single"):
        spec_workloads(bench_args("--workloads", "single"))
    with pytest.raises(ValueError, match="--streams"):
        spec_workloads(bench_args("--streams", "one"))
    with pytest.raises(ValueError, match="one round"):
        spec_workloads(bench_args("--rounds", "0"))


def test_inferd_counters_are_read_from_metrics_text() -> None:
    exposition = "\n".join(
        [
            "# HELP inferd_speculative_draft_tokens_total Drafted tokens",
            'inferd_speculative_draft_tokens_total{model="default"} 120.0',
            'inferd_speculative_draft_tokens_total{model="other"} 30.0',
            'inferd_speculative_accepted_tokens_total{model="default"} 90.0',
            'inferd_prompt_tokens_total{model="default"} 5000.0',
        ]
    )
    assert parse_counters(exposition) == (150, 90)


def test_llama_server_draft_counts_reach_the_summary() -> None:
    timing = RequestTiming(started=0.0)
    _consume('data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}', timing)
    last = (
        'data: {"choices":[],"usage":{"completion_tokens":79},'
        '"timings":{"predicted_n":79,"draft_n":96,"draft_n_accepted":66}}'
    )
    _consume(last, timing)
    _consume("data: [DONE]", timing)
    summary = summarize("copy", "llama-server ngram-simple", [timing, timing], 2.0)
    assert (summary.drafted, summary.accepted) == (192, 132)
    assert summary.acceptance == pytest.approx(66 / 96)
    plain = summarize("copy", "llama-server off", [RequestTiming(started=0.0)], 1.0)
    assert plain.drafted is None and plain.acceptance is None


def run(tps: float, drafted: int | None = None, accepted: int | None = None) -> Summary:
    return Summary("w", "e", 1, 0, round(tps * 10), 10.0, 0, 0, 0, 0, None, drafted, accepted)


def test_the_table_gives_medians_ratios_acceptance_and_unavailable_peers() -> None:
    workload = spec_workload("copy", 1)
    result = Comparison([workload])
    for tps in (10.0, 30.0, 20.0):  # median 20
        result.add(workload, INFERD_OFF, run(tps))
    for tps, accepted in ((50.0, 30), (40.0, 10)):  # median 45; 40 of 80 drafted accepted
        result.add(workload, INFERD_NGRAM, run(tps, 40, accepted))
    result.unavailable[LLAMA_OFF.label] = "PeerUnavailable: no llama-server"
    result.unavailable[LLAMA_NGRAM.label] = "PeerUnavailable: no llama-server"
    table = render(result)
    row = next(line for line in table.splitlines() if line.startswith("| copy, 1 stream"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:5] == ["20.0", "45.0", "2.25x", "50%"]
    assert cells[5:7] == ["unavailable", "unavailable"] and cells[-1] == "n/a"
    assert "llama-server ngram-simple: unavailable (PeerUnavailable: no llama-server)" in table


def test_a_short_real_run_measures_inferd_and_reports_a_missing_llama_server(
    smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    workloads = [spec_workload("copy", 2, max_tokens=6)]
    starter = server_starter(smollm2_gguf, 2, ["--dtype", "f32", "--max-seq-len", "1024"])
    result = compare(starter, workloads, rounds=1)
    assert set(result.unavailable) == {LLAMA_OFF.label, LLAMA_NGRAM.label}
    assert "no llama-server" in result.unavailable[LLAMA_NGRAM.label]
    for w in workloads:
        off, ngram = (
            result.runs[(w.name, INFERD_OFF.label)],
            result.runs[(w.name, INFERD_NGRAM.label)],
        )
        assert off[0].incomplete == ngram[0].incomplete == 0
        # Copies of a given passage: every request runs to max_tokens, on and off.
        assert off[0].output_tokens == ngram[0].output_tokens == w.requests * 6
        assert off[0].drafted == 0  # speculation off drafts nothing
        assert ngram[0].drafted is not None and ngram[0].accepted is not None
        assert 0 <= ngram[0].accepted <= ngram[0].drafted
    table = render(result)
    assert "| copy, 2 streams | " in table and "unavailable" in table
