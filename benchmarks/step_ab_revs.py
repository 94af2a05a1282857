"""Decode steps of this tree and of another git revision of inferd, alternating in one process.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/step_ab_revs.py --old main --rows 1,16 \\
        --steps 40 [--threads 1]

For Python-side changes, which ``step_ab.py`` cannot switch at run time: the ``--old``
revision's ``inferd`` is exported (``git archive``) into a temporary folder as a package named
``inferd_old`` (its imports renamed), and both trees load SmolLM2 side by side. Each first
generates ``rows`` greedy replies of 32 tokens (the script says whether the tokens are
identical), then the same requests are stepped with the trees alternating step by step (who
goes first alternates too), so drift of a loaded machine hits both alike; medians and their
ratio are printed. One thread by default: on a shared 2-core machine two threads of OpenMP
kernels waited on each other for milliseconds, which swamps what this measures.
"""

from __future__ import annotations

import argparse
import importlib
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from step_ab import finish  # benchmarks/ is on sys.path when this script runs

import inferd

IMPORT = re.compile(r"\b(from|import) inferd(\.| |$)", re.MULTILINE)
NAMED = re.compile(r"\"inferd\.((?:[a-z_0-9]+\.)*[a-z_0-9]+)\"")


def export_old(rev: str, into: Path) -> None:
    """``inferd`` at ``rev`` as the package ``inferd_old`` under ``into``."""
    repo = Path(inferd.__file__).resolve().parents[1]
    data = subprocess.run(
        ["git", "-C", str(repo), "archive", rev, "inferd"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    (into / "inferd").rename(into / "inferd_old")
    for path in (into / "inferd_old").rglob("*.py"):
        text = path.read_text()
        text = NAMED.sub(r'"inferd_old.\1"', IMPORT.sub(r"\1 inferd_old\2", text))
        path.write_text(text)


def load(package: str) -> Any:
    mod = {n: importlib.import_module(f"{package}.{n}") for n in ("config", "source")}
    served: ModuleType = importlib.import_module(f"{package}.serving.served")
    driver = importlib.import_module(f"{package}.engine.driver")
    cfg = mod["config"].EngineConfig(max_num_seqs=16, speculative="off", prefix_caching=False)
    source = mod["source"].resolve_source("smollm2")
    return served.load_model(source, cfg, progress=False, loop=driver.CallerLoop())


def start(served: Any, package: str, tag: str, rows: int, tokens: int) -> None:
    sampling = importlib.import_module(f"{package}.engine.sampling")
    engine = served.engine.engine
    params = sampling.SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i in range(rows):
        text = f"Write a story about topic {i}."
        prompt = served.chat_prompt([{"role": "user", "content": text}]).ids
        engine.add_request(f"{tag}-{i}", prompt, params)
    while any(not r.output_token_ids for r in engine._core.requests.values()):
        engine.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", default="main", help="git revision of the 'old' tree")
    parser.add_argument("--rows", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = tempfile.mkdtemp(prefix="inferd-ab-")
    export_old(args.old, Path(folder))
    sys.path.insert(0, folder)
    trees = {"old": "inferd_old", "new": "inferd"}
    served = {tree: load(package) for tree, package in trees.items()}
    for rows in [int(r) for r in args.rows.split(",") if r]:
        replies = {}
        for tree, package in trees.items():
            start(served[tree], package, "t", rows, 32)
            replies[tree] = finish(served[tree].engine.engine)
        for tree, package in trees.items():
            start(served[tree], package, "ab", rows, args.steps + 8)
            served[tree].engine.engine.step()
        times: dict[str, list[float]] = {tree: [] for tree in trees}
        for i in range(args.steps):
            for tree in ("old", "new") if i % 2 else ("new", "old"):
                began = time.perf_counter()
                served[tree].engine.engine.step()
                times[tree].append(time.perf_counter() - began)
        for tree in trees:
            finish(served[tree].engine.engine)
        old, new = (statistics.median(times[t]) * 1000 for t in ("old", "new"))
        print(
            f"{rows} rows, {args.threads} threads: greedy tokens identical "
            f"{replies['old'] == replies['new']}; {args.old} {old:.2f} ms, this tree "
            f"{new:.2f} ms a step ({old / new:.3f}x, medians of {args.steps})",
            flush=True,
        )
    for s in served.values():
        s.shutdown()


if __name__ == "__main__":
    main()
