"""What a JSON schema costs: throughput and TTFT with ``response_format`` json_schema against
unconstrained, at 1 and 16 concurrent streams, on inferd and on llama.cpp in the same run.

    PYTHONPATH=. .venv/bin/python benchmarks/structured_cost.py [--rounds N] [--out PREFIX]
        [--peer llama-server|llama.cpp-server|none] [--quick] [--max-tokens N]

inferd is started as ``inferd serve`` with default settings; the peer on the same GGUF file:
``llama-server`` (llama.cpp's own server, ``-np 16``; from PATH or ``$LLAMA_SERVER``, built by
``build-llama-server.sh``) or, without it, llama-cpp-python's server (one request at a time). Both
get the same chat prompts, the same schema (a six-item product catalog: about 120 tokens of
JSON) in OpenAI's ``response_format`` form, greedy decoding and 128 tokens at most; the same
HTTP clients (inferd/bench/http.py) time every streamed token. Each round runs free then
schema back to back per workload, so load drifts hit both; the medians over rounds are kept.
Afterwards one schema request per server is checked: the output must parse and validate, or
the peer did not constrain. Writes PREFIX.json and PREFIX.md (default benchmarks/structured_cost).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema

from inferd.bench.http import run_http
from inferd.bench.process import serve_subprocess
from inferd.bench.server_peers import PeerUnavailable, start_peer_server
from inferd.bench.workloads import TOPICS, Workload
from inferd.store import DEFAULT_MODEL, ModelStore

MAX_TOKENS = 128
ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "price": {"type": "number", "minimum": 0, "maximum": 1000},
        "in_stock": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue", "black"]},
    },
    "required": ["name", "price", "in_stock", "color"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {
        "shop": {"type": "string", "maxLength": 24},
        "products": {"type": "array", "items": ITEM, "minItems": 6, "maxItems": 6},
    },
    "required": ["shop", "products"],
    "additionalProperties": False,
}
FORMAT = {
    "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "catalog", "schema": SCHEMA, "strict": True},
    }
}


@dataclass(frozen=True, slots=True)
class CatalogWorkload(Workload):
    """The bench's workload shape with a prompt that asks for the catalog as JSON."""

    def messages(self, index: int) -> list[dict[str, str]]:
        topic = TOPICS[index % len(TOPICS)]
        ask = f"Write the product catalog of a shop run by {topic}, as JSON. Catalog {index}."
        return [{"role": "user", "content": ask}]


def workloads(quick: bool, max_tokens: int) -> list[CatalogWorkload]:
    """1 stream (4 requests) and 16 streams (32 requests); ``quick``: half as many."""
    scale = 2 if quick else 1
    return [
        CatalogWorkload("1 stream", 4 // scale, 1, max_tokens),
        CatalogWorkload("16 streams", 32 // scale, 16, max_tokens),
    ]


@dataclass(frozen=True, slots=True)
class Row:
    server: str
    workload: str
    mode: str  # free | schema
    tokens_per_s: float
    ttft_p50_ms: float
    itl_p50_ms: float
    output_tokens: int
    incomplete: int


@contextmanager
def start_inferd(gguf: Path, log: Path) -> Iterator[str]:
    with serve_subprocess(["-m", str(gguf)], log) as (url, _):
        yield url + "/v1"


def measure(name: str, api: str, rounds: int, quick: bool, max_tokens: int) -> list[Row]:
    model = httpx.get(api + "/models", timeout=30).json()["data"][0]["id"]
    warm = CatalogWorkload("warm-up", 1, 1, 16)
    asyncio.run(run_http(api, model, warm, name, FORMAT))  # kernels, caches, the grammar
    runs: dict[tuple[str, str], list[Any]] = {}
    for _ in range(rounds):
        for workload in workloads(quick, max_tokens):
            for mode, extra in (("free", {}), ("schema", FORMAT)):
                summary = asyncio.run(run_http(api, model, workload, name, extra))
                runs.setdefault((workload.name, mode), []).append(summary)
    rows = []
    for (workload, mode), summaries in runs.items():
        rows.append(
            Row(
                server=name,
                workload=workload,
                mode=mode,
                tokens_per_s=statistics.median(s.tokens_per_second for s in summaries),
                ttft_p50_ms=statistics.median(s.ttft_p50 for s in summaries) * 1e3,
                itl_p50_ms=statistics.median(s.itl_p50 for s in summaries) * 1e3,
                output_tokens=int(statistics.median(s.output_tokens for s in summaries)),
                incomplete=max(s.incomplete for s in summaries),
            )
        )
    return rows


def check_constrained(api: str) -> str:
    """One schema reply: 'valid', or what is wrong with it (the server ignored the schema)."""
    body = {
        "messages": CatalogWorkload("check", 1, 1, 400).messages(0),
        "max_tokens": 400,
        "temperature": 0,
        **FORMAT,
    }
    reply = httpx.post(api + "/chat/completions", json=body, timeout=600).json()
    text = reply["choices"][0]["message"]["content"] or ""
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
        return f"invalid: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
    return "valid"


def costs(rows: list[Row]) -> list[dict[str, Any]]:
    """Per server and workload: schema over free for tokens/s, TTFT and inter-token latency."""
    by = {(r.server, r.workload, r.mode): r for r in rows}
    out = []
    for (server, workload, mode), free in by.items():
        schema = by.get((server, workload, "schema"))
        if mode != "free" or schema is None:
            continue
        out.append(
            {
                "server": server,
                "workload": workload,
                "throughput_cost": 1 - schema.tokens_per_s / free.tokens_per_s,
                "ttft_ratio": schema.ttft_p50_ms / free.ttft_p50_ms,
                "itl_ratio": schema.itl_p50_ms / free.itl_p50_ms,
            }
        )
    return out


def markdown(rows: list[Row], cost: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"Load before the run: {meta['load']}. Rounds: {meta['rounds']}. Peer: {meta['peer']}. "
        f"Quick: {meta['quick']}. max_tokens: {meta['max_tokens']}.",
        f"Schema outputs checked: {meta['checks']}.",
        "",
        "| server | workload | mode | tokens/s | TTFT p50 ms | ITL p50 ms | tokens | incomplete |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.server} | {r.workload} | {r.mode} | {r.tokens_per_s:.1f} | "
            f"{r.ttft_p50_ms:.0f} | {r.itl_p50_ms:.1f} | {r.output_tokens} | {r.incomplete} |"
        )
    lines += [
        "",
        "| server | workload | throughput cost of the schema | TTFT ratio | ITL ratio |",
        "|---|---|---|---|---|",
    ]
    for c in cost:
        lines.append(
            f"| {c['server']} | {c['workload']} | {c['throughput_cost']:.1%} | "
            f"{c['ttft_ratio']:.2f} | {c['itl_ratio']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/structured_cost")
    parser.add_argument("--peer", default="llama-server")
    parser.add_argument("--quick", action="store_true", help="half the requests (busy machine)")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    args = parser.parse_args()
    gguf = ModelStore().entry_path(DEFAULT_MODEL)
    if gguf is None:
        raise SystemExit(f"pull the default model first: inferd pull {DEFAULT_MODEL}")
    meta: dict[str, Any] = {
        "load": Path("/proc/loadavg").read_text().split()[:3],
        "rounds": args.rounds,
        "peer": args.peer,
        "quick": args.quick,
        "max_tokens": args.max_tokens,
        "checks": {},
    }
    rows: list[Row] = []
    logs = Path(tempfile.mkdtemp(prefix="structured-cost-"))
    servers = [("inferd", lambda s: s.enter_context(start_inferd(gguf, logs / "inferd.log")))]
    if args.peer != "none":
        threads = os.cpu_count() or 2
        servers.append(
            (
                args.peer,
                lambda s: s.enter_context(
                    start_peer_server(args.peer, gguf, threads, logs / "peer.log")
                ),
            )
        )
    for name, start in servers:  # one server at a time: they would share the cores
        with ExitStack() as stack:
            try:
                api = start(stack)
            except (PeerUnavailable, subprocess.SubprocessError, RuntimeError) as exc:
                meta["checks"][name] = f"not run: {exc}"
                continue
            rows += measure(name, api, args.rounds, args.quick, args.max_tokens)
            meta["checks"][name] = check_constrained(api)
    cost = costs(rows)
    prefix = Path(args.out)
    result = {"meta": meta, "rows": [asdict(r) for r in rows], "costs": cost, "schema": SCHEMA}
    prefix.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(rows, cost, meta)
    prefix.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
