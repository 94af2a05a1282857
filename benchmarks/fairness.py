"""A short request's time to first token while one heavy request runs, over HTTP.

    .venv/bin/python benchmarks/fairness.py [--prompt-tokens 4000] [--n 16] [--shorts 5]
        [--server-arg=--max-logprobs-tokens=100000000 ...]

Starts `inferd serve` on the default model (whichever `inferd` this Python imports: run it with
PYTHONPATH pointing at another checkout to measure that one), then:

1. the short request alone (a streamed completion, 8 tokens), as the baseline;
2. the heavy one: `echo` + `logprobs: 20` + `n` choices on a long prompt, non-streamed;
3. while it runs, the short request again, one after another, each timed to its first token.

The table gives the short request's TTFT alone and under the heavy one (median and worst),
and the heavy one's wall time and response size. The heavy request is larger than the default
`--max-logprobs-tokens` allows, so pass a higher bound to let it run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from inferd.bench.process import serve_subprocess
from inferd.store import DEFAULT_MODEL, ModelStore

SHORT = {"prompt": "The three primary colors are", "max_tokens": 8, "temperature": 0}


def short_ttft(api: str) -> float:
    """Seconds from sending a short streamed completion to its first text."""
    started = time.perf_counter()
    with httpx.stream(
        "POST", api + "/completions", json=SHORT | {"stream": True}, timeout=600
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text":""' not in line:
                return time.perf_counter() - started
    raise RuntimeError("the short request produced no text")


def heavy(api: str, prompt_tokens: int, n: int, result: dict[str, Any]) -> None:
    body = {
        "prompt": "word " * prompt_tokens,
        "echo": True,
        "logprobs": 20,
        "n": n,
        "max_tokens": 16,
        "temperature": 0.7,
    }
    started = time.perf_counter()
    r = httpx.post(api + "/completions", json=body, timeout=3600)
    result |= {
        "status": r.status_code,
        "seconds": time.perf_counter() - started,
        "bytes": len(r.content),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--shorts", type=int, default=5, help="short requests timed under load")
    p.add_argument("--server-arg", action="append", default=[], help="extra `inferd serve` flag")
    args = p.parse_args()
    model = ModelStore().entry_path(DEFAULT_MODEL)
    assert model is not None, "run `inferd pull` first"
    serve = ["-m", str(model), "--max-seq-len", str(args.prompt_tokens + 512), *args.server_arg]
    log = Path(tempfile.mkdtemp()) / "serve.log"
    with serve_subprocess(serve, log) as (url, _):
        api = url + "/v1"
        short_ttft(api)  # warm-up
        alone = [short_ttft(api) for _ in range(3)]
        result: dict[str, Any] = {}
        worker = threading.Thread(target=heavy, args=(api, args.prompt_tokens, args.n, result))
        worker.start()
        time.sleep(1.0)  # the heavy request is admitted and prefilling
        loaded = [short_ttft(api) for _ in range(args.shorts) if worker.is_alive()]
        worker.join()
    print(f"heavy: {args.prompt_tokens}-token prompt, echo, logprobs 20, n={args.n}")
    print("| short TTFT alone | under load p50 | under load max | heavy | heavy response |")
    print("|---|---|---|---|---|")
    under = f"{statistics.median(loaded):.2f} s | {max(loaded):.2f} s" if loaded else "- | -"
    print(
        f"| {statistics.median(alone):.2f} s | {under} | "
        f"{result['status']} in {result['seconds']:.1f} s | {result['bytes'] / 2**20:.1f} MiB |"
    )


if __name__ == "__main__":
    main()
