"""Time a SmolLM2 decode step on the main thread and on another thread, with 1 and 2 threads.

    .venv/bin/python benchmarks/threads.py [BATCH]

The measurement behind inferd/engine/driver.py: PyTorch's intra-op parallelism helped only on the
main thread here, so `inferd serve` steps its engines there.
"""

from __future__ import annotations

import sys
import threading
import time

import torch

from inferd.config import EngineConfig
from inferd.engine.driver import CallerLoop
from inferd.engine.sampling import SamplingParams
from inferd.serving.served import load_model
from inferd.source import resolve_source


def main(batch: int) -> None:
    served = load_model(
        resolve_source("smollm2"), EngineConfig(dtype="bf16"), progress=False, loop=CallerLoop()
    )
    engine = served.engine.engine  # this script steps the engine itself
    prompt = served.chat_prompt([{"role": "user", "content": "Write a long story."}]).ids
    params = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", prompt, params)

    def run(where: str, threads: int) -> None:
        torch.set_num_threads(threads)
        for _ in range(3):
            engine.step()
        start = time.perf_counter()
        for _ in range(20):
            engine.step()
        print(f"| {where} | {threads} | {(time.perf_counter() - start) / 20 * 1000:.1f} ms |")

    print(f"batch {batch}\n| thread | torch threads | step |\n|---|---|---|")
    for threads in (1, 2):
        other = threading.Thread(target=run, args=("other", threads))
        other.start()
        other.join()
    for threads in (1, 2):
        run("main", threads)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
