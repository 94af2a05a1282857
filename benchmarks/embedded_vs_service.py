"""The same cases in process (``inferd.LLM``) and over HTTP (``inferd serve`` on loopback): what
the service costs a caller that could embed the engine instead (issue 37, the contract's
embedded-vs-service comparison).

Each case is a chat turn answered greedily to ``--tokens`` tokens (``ignore_eos``), on the
default model (SmolLM2-135M) with the default settings on both sides. Measured, alternating
embedded and service over ``--rounds`` so drift falls on both:

- latency: the cases one after another, each request's wall time (the embedded side through
  ``LLM.chat``, the service side a non-streaming chat completion over loopback): the median;
- throughput: all the cases at once (``LLM.chat`` with the batch; concurrent HTTP requests):
  output tokens per second.

The answers must be the same text on both sides (greedy; the same template and engine), or the
comparison is void: the script says so and exits 1.

    PYTHONPATH=. .venv/bin/python benchmarks/embedded_vs_service.py --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from inferd import LLM, SamplingParams
from inferd.bench.process import serve_subprocess

CASES = [
    "Explain what a prefix cache is in two sentences.",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
    "What is the capital of France, and why is it famous?",
    "Describe a cat to someone who has never seen one.",
    "Give me a short recipe for pancakes.",
    "Why is the sky blue?",
    "Summarize the plot of a detective story in one paragraph.",
]


def _messages(case: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": case}]


def embedded(llm: LLM, tokens: int) -> tuple[list[float], float, list[str]]:
    """Per-case latencies (one at a time), batch tokens/s, and the answers."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    latencies, answers = [], []
    for case in CASES:
        started = time.perf_counter()
        out = llm.chat(_messages(case), params, use_tqdm=False)[0]
        latencies.append(time.perf_counter() - started)
        answers.append(out.outputs[0].text)
    started = time.perf_counter()
    outs = llm.chat([_messages(c) for c in CASES], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return latencies, generated / elapsed, answers


def _body(case: str, tokens: int) -> dict[str, object]:
    return {
        "model": "default",
        "messages": _messages(case),
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


def service(url: str, tokens: int) -> tuple[list[float], float, list[str]]:
    """The same over HTTP: sequential requests, then all at once."""
    latencies, answers = [], []
    with httpx.Client(base_url=url, timeout=300) as client:
        for case in CASES:
            started = time.perf_counter()
            reply = client.post("/v1/chat/completions", json=_body(case, tokens))
            latencies.append(time.perf_counter() - started)
            reply.raise_for_status()
            answers.append(reply.json()["choices"][0]["message"]["content"])

    async def together() -> tuple[int, float]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            started = time.perf_counter()
            replies = await asyncio.gather(
                *(client.post("/v1/chat/completions", json=_body(c, tokens)) for c in CASES)
            )
            elapsed = time.perf_counter() - started
        return sum(r.json()["usage"]["completion_tokens"] for r in replies), elapsed

    generated, elapsed = asyncio.run(together())
    return latencies, generated / elapsed, answers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    results: dict[str, dict[str, list[float]]] = {
        side: {"latency": [], "throughput": []} for side in ("embedded", "service")
    }
    answers: dict[str, list[str]] = {}
    with (
        tempfile.TemporaryDirectory() as tmp,
        LLM("smollm2") as llm,
        serve_subprocess([], Path(tmp) / "serve.log") as (url, _),
    ):
        for _ in range(args.rounds):
            for side in ("embedded", "service"):
                if side == "embedded":
                    lat, tps, said = embedded(llm, args.tokens)
                else:
                    lat, tps, said = service(url, args.tokens)
                results[side]["latency"].append(statistics.median(lat))
                results[side]["throughput"].append(tps)
                answers.setdefault(side, said)
    if answers["embedded"] != answers["service"]:
        print("the answers differ between the sides: no comparison", file=sys.stderr)
        return 1
    print(f"{len(CASES)} chat cases, greedy, {args.tokens} tokens each, {args.rounds} rounds")
    medians = {
        side: {k: statistics.median(v) for k, v in figures.items()}
        for side, figures in results.items()
    }
    for side, m in medians.items():
        print(
            f"{side:9s} latency median {m['latency'] * 1000:.1f} ms, "
            f"{len(CASES)} at once {m['throughput']:.1f} tokens/s"
        )
    e, s = medians["embedded"], medians["service"]
    print(
        f"service/embedded: latency {s['latency'] / e['latency']:.3f}x, "
        f"throughput {s['throughput'] / e['throughput']:.3f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
