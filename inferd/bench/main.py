"""`inferd bench`: inferd over HTTP against peers (in-process, or their own servers over the
same HTTP client), one table of ratios."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING

from inferd.bench.http import run_http
from inferd.bench.peers import PEERS, run_serial
from inferd.bench.process import ServerProcess, start_server
from inferd.bench.server_peers import PARALLEL_SLOTS, SERVER_PEERS, start_peer_server
from inferd.bench.spec_compare import SETTINGS
from inferd.bench.spec_workloads import KINDS as SPEC_KINDS
from inferd.bench.spec_workloads import spec_workload
from inferd.bench.stats import Summary
from inferd.bench.workloads import DEFAULT_WORKLOADS, WORKLOADS, Workload
from inferd.config import EngineConfig

if TYPE_CHECKING:
    from inferd.source import ModelSource


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default="smollm2", help="model for inferd and the peers")
    p.add_argument("--url", help="measure this OpenAI-compatible server instead of starting one")
    p.add_argument(
        "--workloads",
        default=None,
        help=f"comma-separated, from: {', '.join(WORKLOADS)} (default: "
        f"{','.join(DEFAULT_WORKLOADS)}); with --speculative, from: "
        f"{', '.join(SPEC_KINDS)} (all)",
    )
    p.add_argument(
        "--peers",
        default="llama.cpp,llama.cpp-server,llama-server,mistral.rs,transformers",
        help="comma-separated peers to run when installed ('' for none)",
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="instead: sweep prompt length, generation length and concurrency on an engine in "
        "this process (no HTTP, no peers)",
    )
    p.add_argument(
        "--speculative",
        action="store_true",
        help="instead: speculative decoding off and on, inferd (--speculative off, ngram) beside "
        "llama-server (without and with --spec-type ngram-simple), on copy/edit, summarize and "
        "free-generation workloads at --streams",
    )
    p.add_argument(
        "--streams",
        default="1,16",
        help="with --speculative: comma-separated concurrent stream counts (default: 1,16)",
    )
    p.add_argument(
        "--rounds", type=int, default=3, help="with --speculative: rounds; medians are printed"
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="with --speculative: tokens each request generates at most (default: the "
        "workload's: copy 256, summarize 128, free 128)",
    )
    p.add_argument("--threads", type=int, default=2, help="threads for the peers")
    p.add_argument(
        "--api",
        choices=["auto", "chat", "completions"],
        default="auto",
        help="what the requests use: chat, or plain-text prompts to /v1/completions (auto: "
        "completions when the model has no chat template, as base models like gemma3)",
    )
    p.add_argument("--json", type=Path, help="also write every figure to this file")
    p.add_argument(
        "--isq",
        choices=["q8", "q4"],
        default=None,
        help="serve inferd with in-situ quantization (the ISQ speed entry; same as -- --isq)",
    )
    p.add_argument(
        "serve_args", nargs=argparse.REMAINDER, help="after --: extra `inferd serve` flags"
    )


def main(args: argparse.Namespace) -> int:
    from inferd.source import resolve_source

    source = resolve_source(args.model)
    gguf = source.path
    if args.speculative:
        return _speculative(args, gguf)
    chosen = [w for w in (args.workloads or ",".join(DEFAULT_WORKLOADS)).split(",") if w]
    unknown = set(chosen) - set(WORKLOADS)
    if unknown:
        raise ValueError(f"unknown workloads: {', '.join(sorted(unknown))}")
    workloads = _workloads(args.api, gguf)
    if args.in_process:
        return _sweep(args, source)
    extra = [a for a in args.serve_args if a != "--"]
    widest = max(workloads[key].concurrency for key in chosen)
    if widest > EngineConfig().max_num_seqs and "--max-seqs" not in extra:
        extra += ["--max-seqs", str(widest)]  # every stream decoding, as llama-server's slots
    if args.isq is not None:
        extra += ["--isq", args.isq]
    results: list[Summary] = []
    with _inferd(args.url, gguf, extra) as (url, server):
        for key in chosen:
            results.append(asyncio.run(run_http(url, "default", workloads[key])))
        rss = server.peak_rss_mb() if server else None
    if "shared" in chosen and args.url is None:
        with _inferd(None, gguf, [*extra, "--prefix-caching", "off"]) as (url, _):
            off = asyncio.run(
                run_http(url, "default", workloads["shared"], "inferd (no prefix cache)")
            )
        results.append(off)
    for name in [p for p in args.peers.split(",") if p]:
        results += _run_peer(name, gguf, args.threads, chosen, workloads)
    print(render(results, rss))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


def _speculative(args: argparse.Namespace, gguf: Path) -> int:
    from inferd.bench.spec_compare import compare, log_progress, server_starter
    from inferd.bench.spec_compare import render as render_spec

    if args.url is not None:
        raise ValueError("--speculative starts its own servers (inferd twice): drop --url")
    workloads = spec_workloads(args, _text_api(args.api, gguf))
    settings = [s for s in SETTINGS if s.engine == "inferd" or s.engine in args.peers.split(",")]
    extra = [a for a in args.serve_args if a != "--"]
    if args.isq is not None:
        extra += ["--isq", args.isq]
    starter = server_starter(gguf, args.threads, extra)
    # Four servers run under this process: a SIGTERM (a timeout) must stop them too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = compare(starter, workloads, args.rounds, settings, progress=log_progress)
    for s in SETTINGS:
        if s not in settings:
            result.unavailable[s.label] = "not in --peers"
    print(render_spec(result))
    if args.json:
        figures = [asdict(r) for runs in result.runs.values() for r in runs]
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


def spec_workloads(args: argparse.Namespace, text: bool = False) -> list[Workload]:
    """The --speculative workloads the arguments choose, each at each stream count."""
    kinds = [k for k in (args.workloads or ",".join(SPEC_KINDS)).split(",") if k]
    unknown = set(kinds) - set(SPEC_KINDS)
    if unknown:
        raise ValueError(f"unknown --speculative workloads: {', '.join(sorted(unknown))}")
    try:
        streams = [int(s) for s in args.streams.split(",") if s]
    except ValueError:
        raise ValueError(f"--streams takes comma-separated counts, not {args.streams!r}") from None
    if not streams or args.rounds < 1:
        raise ValueError("--speculative needs at least one stream count and one round")
    return [
        replace(spec_workload(kind, n, args.max_tokens), text=text)
        for kind in kinds
        for n in streams
    ]


def _sweep(args: argparse.Namespace, source: ModelSource) -> int:
    from inferd.bench.sweep import peak_rss_mb, run_point, sweep_points
    from inferd.engine.driver import CallerLoop
    from inferd.serving.served import load_model

    # The sweep steps the engine on this (main) thread, as `inferd serve` does.
    served = load_model(source, EngineConfig(isq=args.isq), progress=True, loop=CallerLoop())
    results = [run_point(served, point) for point in sweep_points()]
    print(render(results, None))
    print(f"\npeak RSS of this process: {peak_rss_mb():.0f} MiB")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


@contextmanager
def _inferd(
    url: str | None, gguf: Path, extra: Sequence[str]
) -> Iterator[tuple[str, ServerProcess | None]]:
    if url is not None:
        yield url.rstrip("/"), None
        return
    with (
        tempfile.TemporaryDirectory() as tmp,
        start_server(gguf, extra, Path(tmp) / "serve.log") as server,
    ):
        yield server.api, server


def _workloads(api: str, gguf: Path) -> dict[str, Workload]:
    """The workloads, as plain-text completions when asked or when the model has no chat
    template (a base model: chat would be refused)."""
    text = _text_api(api, gguf)
    return {key: replace(w, text=text) for key, w in WORKLOADS.items()}


def _text_api(api: str, gguf: Path) -> bool:
    """Whether requests are plain-text completions (asked, or a model without chat template)."""
    if api == "auto" and gguf.suffix == ".gguf":
        from inferd.loading.gguf import GGUFFile

        return not GGUFFile(gguf).metadata.get("tokenizer.chat_template")
    return api == "completions"


def _run_peer(
    name: str,
    gguf: Path,
    threads: int,
    chosen: list[str],
    workloads: dict[str, Workload] = WORKLOADS,
) -> list[Summary]:
    if name in SERVER_PEERS:
        return _run_server_peer(name, gguf, threads, chosen, workloads)
    factory = PEERS.get(name)
    if factory is None:
        print(f"skip {name}: unknown peer", file=sys.stderr)
        return []
    try:
        stream = factory(gguf, threads)
    except Exception as exc:  # a missing or broken peer must not sink the run
        print(f"skip {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return []
    return [
        run_serial(stream, workloads[key], name)
        for key in chosen
        if (key != "long" or name != "transformers") and key != "concurrent64"
    ]


# What the targets compare over HTTP
SERVER_PEER_WORKLOADS = ("single", "concurrent", "concurrent64")


def _run_server_peer(
    name: str,
    gguf: Path,
    threads: int,
    chosen: list[str],
    workloads: dict[str, Workload] = WORKLOADS,
) -> list[Summary]:
    keys = [k for k in chosen if k in SERVER_PEER_WORKLOADS]
    # One server per slot count: a workload of more streams than PARALLEL_SLOTS gets its own.
    by_slots: dict[int, list[str]] = {}
    for key in keys:
        by_slots.setdefault(max(PARALLEL_SLOTS, workloads[key].concurrency), []).append(key)
    results: list[Summary] = []
    for slots, group in by_slots.items():
        try:
            with (
                tempfile.TemporaryDirectory() as tmp,
                start_peer_server(name, gguf, threads, Path(tmp) / "peer.log", slots=slots) as api,
            ):
                for key in group:
                    results.append(asyncio.run(run_http(api, "default", workloads[key], name)))
        except Exception as exc:  # a missing or broken peer must not sink the run
            print(f"skip {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
    return results


def render(results: list[Summary], inferd_rss_mb: float | None) -> str:
    lines = [
        "| workload | engine | tokens/s | req/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | "
        "incomplete | vs inferd |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    ours = {r.name: r for r in results if r.engine == "inferd"}
    for r in results:
        base = ours.get(r.name)
        ratio = (
            ""
            if base is None or r is base
            else f"inferd {_ratio(base.tokens_per_second, r.tokens_per_second)}"
        )
        lines.append(
            f"| {r.name} | {r.engine} | {r.tokens_per_second:.1f} | "
            f"{r.requests_per_second:.2f} | {_ms(r.ttft_p50)} | {_ms(r.ttft_p99)} | "
            f"{_ms(r.itl_p50)} | {_ms(r.itl_p99)} | {r.incomplete} | {ratio} |"
        )
    if inferd_rss_mb is not None:
        lines.append(f"\npeak RSS of `inferd serve`: {inferd_rss_mb:.0f} MiB")
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def _ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1000:.0f} ms"
