"""Prefix-aware routing against Ray Serve's default, on two replicas of the default model.

    PYTHONPATH=. .venv/bin/python benchmarks/ray_routing.py [--clients 32] [--rounds 2]

Starts a local Ray cluster (loopback) and, for each routing mode in turn, deploys inferd with two
replicas (fresh KV caches), then runs the same workload: ``--clients`` concurrent clients, each
holding one of four long system prompts (client i has prompt i % 4), each sending ``--rounds``
streamed chat requests one after another with a question of its own. Reports time to first
token (p50 / p99, over every request), the prefix-cache hit rate (prompt tokens served from
cache / prompt tokens looked up, summed over the replicas, from /metrics) and how many of the
four prompts were served by more than one replica.

Modes: "prefix" (inferd's router: the replica that saw the prompt's head, within an imbalance
bound) and "serve_default" (Serve's power-of-two-choices, which ignores the prompt).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

import httpx
import ray
from ray import serve

from inferd.config import EngineConfig
from inferd.ray.args import Scale
from inferd.ray.deployment import APP_NAME, build_deployment
from inferd.serving.spec import ModelSpec
from inferd.store import DEFAULT_MODEL, ModelStore

TOPICS = ("the lighthouse museum", "a mountain railway", "a city library", "a harbour ferry")


def system_prompt(topic: str, repeat: int) -> str:
    return (
        f"You are the help desk of {topic}. Visitors ask about opening hours, tickets, "
        "accessibility, the shop, the café, guided tours and lost property. Answer in one "
        "short sentence, politely, and never invent prices or times you were not given. "
    ) * repeat  # 6: ~1.5k characters, ~300 tokens


@dataclass
class Result:
    mode: str
    ttfts: list[float]
    hits: float
    queries: float
    split_prompts: int
    wall: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _counter(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")
    )


async def _client(
    http: httpx.AsyncClient, url: str, i: int, args: argparse.Namespace, seen: dict[int, set[str]]
) -> list[float]:
    group = i % len(TOPICS)
    ttfts = []
    for r in range(args.rounds):
        body = {
            "messages": [
                {"role": "system", "content": system_prompt(TOPICS[group], args.prompt_repeat)},
                {"role": "user", "content": f"Client {i}, question {r}: is it open on day {r}?"},
            ],
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
        }
        start = time.perf_counter()
        first = None
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            seen[group].add(response.headers["x-inferd-replica"])
            async for line in response.aiter_lines():
                if first is None and line.startswith("data: {") and '"content":"' in line:
                    content = json.loads(line[6:])["choices"][0]["delta"].get("content")
                    if content:
                        first = time.perf_counter() - start
        ttfts.append(first if first is not None else time.perf_counter() - start)
    return ttfts


async def _workload(url: str, args: argparse.Namespace) -> tuple[list[float], int, float]:
    seen: dict[int, set[str]] = defaultdict(set)
    limits = httpx.Limits(max_connections=args.clients * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        start = time.perf_counter()
        per_client = await asyncio.gather(
            *(_client(http, url, i, args, seen) for i in range(args.clients))
        )
        wall = time.perf_counter() - start
    split = sum(1 for replicas in seen.values() if len(replicas) > 1)
    return [t for ts in per_client for t in ts], split, wall


def run_mode(mode: str, url: str, model: str, args: argparse.Namespace) -> Result:
    engine = EngineConfig(max_model_len=2048, kv_cache_tokens=args.kv_cache_tokens)
    app = build_deployment(
        ModelSpec(model_id=model),
        engine,
        scale=Scale(replicas=2),
        num_cpus=0.5,
        prefix_routing=mode == "prefix",
    )
    serve.run(app, name=APP_NAME, route_prefix="/")
    try:
        before = httpx.get(f"{url}/metrics", timeout=120).text
        ttfts, split, wall = asyncio.run(_workload(url, args))
        after = httpx.get(f"{url}/metrics", timeout=120).text
    finally:
        serve.delete(APP_NAME)
    hits = _counter(after, "inferd_prefix_cache_hits_total") - _counter(
        before, "inferd_prefix_cache_hits_total"
    )
    queries = _counter(after, "inferd_prefix_cache_queries_total") - _counter(
        before, "inferd_prefix_cache_queries_total"
    )
    return Result(mode, ttfts, hits, queries, split, wall)


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--prompt-repeat", type=int, default=6, help="system prompt length: 6 is ~300 tokens"
    )
    parser.add_argument(
        "--kv-cache-tokens", type=int, default=8192, help="each replica's KV pool (tokens)"
    )
    parser.add_argument("-m", "--model", default=None, help="default: the store's smollm2")
    args = parser.parse_args()
    model = args.model or str(ModelStore().entry_path(DEFAULT_MODEL))
    port = _free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        results = [run_mode(m, url, model, args) for m in ("serve_default", "prefix")]
    finally:
        serve.shutdown()
        ray.shutdown()
    n = args.clients * args.rounds
    print(
        f"{args.clients} clients x {args.rounds} rounds = {n} streamed requests, 2 replicas, "
        f"KV pool {args.kv_cache_tokens} tokens each, system prompts x{args.prompt_repeat}"
    )
    print("| routing | TTFT p50 s | TTFT p99 s | prefix hit rate | prompts split | wall s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        rate = r.hits / r.queries if r.queries else 0.0
        print(
            f"| {r.mode} | {statistics.median(r.ttfts):.2f} | {_p(r.ttfts, 0.99):.2f} | "
            f"{rate:.1%} | {r.split_prompts} of {len(TOPICS)} | {r.wall:.1f} |"
        )


if __name__ == "__main__":
    main()
