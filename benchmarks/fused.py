"""Time SmolLM2 decode steps with the fused CPU kernels and with the plain PyTorch ops.

    .venv/bin/python benchmarks/fused.py

The measurement behind inferd/kernels: the same engine, the same requests, steps alternating
between the two paths so that drift of the machine hits both alike.
"""

from __future__ import annotations

import statistics
import time

from inferd.config import EngineConfig
from inferd.engine.detokenizer import IncrementalDetokenizer
from inferd.engine.request import Request
from inferd.engine.sampling import SamplingParams
from inferd.kernels import status, unfused
from inferd.serving.served import load_model
from inferd.source import resolve_source


def main() -> None:
    print(status())
    print("| decodes | context | plain PyTorch | fused | ratio |\n|---|---|---|---|---|")
    for batch, repeat in ((1, 1), (1, 40), (16, 1)):
        served = load_model(resolve_source("smollm2"), EngineConfig(dtype="bf16"), progress=False)
        served.engine.shutdown()  # this script steps the core itself
        core = served.engine.core
        text = "Write a long story. " * repeat
        prompt = served.chat_prompt([{"role": "user", "content": text}])
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        for i in range(batch):
            detok = IncrementalDetokenizer(served.tokenizer.id_to_bytes)
            core.add(Request(f"r{i}", list(prompt), params, frozenset(), detok))
        for _ in range(4):  # prefill and warm-up
            core.step()
        plain, fused = [], []
        for _ in range(25):
            with unfused():
                start = time.perf_counter()
                core.step()
                plain.append(time.perf_counter() - start)
            start = time.perf_counter()
            core.step()
            fused.append(time.perf_counter() - start)
        p, f = statistics.median(plain) * 1000, statistics.median(fused) * 1000
        print(f"| {batch} | ~{len(prompt) + 30} | {p:.1f} ms | {f:.1f} ms | {p / f:.2f}x |")


if __name__ == "__main__":
    main()
