"""What the request path costs, between two source trees (issue 33: before/after the pipeline).

For each tree in turn, alternating over ``--rounds`` so drift on the machine falls on both,
``inferd serve`` runs the default model (SmolLM2-135M, default flags, ``PYTHONPATH`` = the
tree) and answers:

- overhead: ``--requests`` sequential non-streaming chat requests of one token (``max_tokens``
  1, the same short prompt, so the prefix cache leaves one decode step of model time): the
  median latency, client side, over loopback;
- throughput: 16 concurrent streaming chat requests of 64 tokens (``inferd.bench.http``):
  aggregate output tokens per second.

    python benchmarks/pipeline_overhead.py --trees /path/before,/path/after --rounds 3

Prints the medians over rounds per tree and the after/before ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from inferd.bench.http import run_http
from inferd.bench.workloads import Workload

MESSAGES = [{"role": "user", "content": "Say yes."}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(tree: Path, port: int) -> subprocess.Popen[bytes]:
    env = os.environ | {"PYTHONPATH": str(tree)}
    command = [sys.executable, "-m", "inferd", "serve", "--port", str(port)]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_ready(url: str, process: subprocess.Popen[bytes]) -> str:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return str(httpx.get(f"{url}/v1/models").json()["data"][0]["id"])
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not become ready in 300 s")


def _overhead(url: str, model: str, requests: int) -> float:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 1, "temperature": 0}
    times = []
    with httpx.Client(timeout=60) as client:
        for _ in range(requests + 5):  # the first five warm the path up
            started = time.perf_counter()
            reply = client.post(f"{url}/v1/chat/completions", json=body)
            times.append(time.perf_counter() - started)
            reply.raise_for_status()
    return statistics.median(times[5:])


def _throughput(url: str, model: str) -> float:
    workload = Workload("streams16", requests=16, concurrency=16, max_tokens=64)
    summary = asyncio.run(run_http(url, model, workload, extra={"ignore_eos": True}))
    return summary.output_tokens / summary.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", required=True, help="comma-separated source trees")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=50)
    args = parser.parse_args()
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    results: dict[Path, list[tuple[float, float]]] = {t: [] for t in trees}
    for round_ in range(args.rounds):
        for tree in trees:
            port = _free_port()
            url = f"http://127.0.0.1:{port}"
            process = _serve(tree, port)
            try:
                model = _wait_ready(url, process)
                overhead = _overhead(url, model, args.requests)
                tokens_per_s = _throughput(url, model)
            finally:
                process.terminate()
                process.wait(timeout=60)
            results[tree].append((overhead, tokens_per_s))
            print(
                f"round {round_ + 1} {tree}: 1-token request {overhead * 1000:.1f} ms, "
                f"16 streams {tokens_per_s:.1f} tok/s",
                flush=True,
            )
    print("\n| tree | 1-token request, median ms | 16 streams, tok/s |\n|---|---|---|")
    medians = {}
    for tree, rows in results.items():
        ms = statistics.median(r[0] for r in rows) * 1000
        tps = statistics.median(r[1] for r in rows)
        medians[tree] = (ms, tps)
        print(f"| {tree} | {ms:.1f} | {tps:.1f} |")
    if len(trees) == 2:
        (ms0, tps0), (ms1, tps1) = medians[trees[0]], medians[trees[1]]
        print(f"\nafter/before: latency {ms1 / ms0:.3f}x, throughput {tps1 / tps0:.3f}x")


if __name__ == "__main__":
    main()
