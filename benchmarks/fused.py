"""Time SmolLM2 decode steps with the fused CPU kernels and with the plain PyTorch ops.

    .venv/bin/python benchmarks/fused.py

The measurement behind inferd/kernels: the same engine, the same requests, steps alternating
between the two paths so that drift of the machine hits both alike.
"""

from __future__ import annotations

import statistics
import time

import torch

from inferd.config import EngineConfig
from inferd.engine.driver import CallerLoop
from inferd.engine.sampling import SamplingParams
from inferd.kernels import load_ops
from inferd.kernels.plain import PlainOps
from inferd.serving.served import load_model
from inferd.source import resolve_source


def main() -> None:
    fused_ops = load_ops(torch.bfloat16)
    print(fused_ops.description)
    print("| decodes | context | plain PyTorch | fused | ratio |\n|---|---|---|---|---|")
    for batch, repeat in ((1, 1), (1, 40), (16, 1)):
        served = load_model(
            resolve_source("smollm2"), EngineConfig(dtype="bf16"), progress=False, loop=CallerLoop()
        )
        engine = served.engine.engine  # this script steps the engine itself
        text = "Write a long story. " * repeat
        prompt = served.chat_prompt([{"role": "user", "content": text}]).ids
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"r{i}", prompt, params)
        for _ in range(4):  # prefill and warm-up
            engine.step()
        plain, fused = [], []
        model = engine.model
        for _ in range(25):
            model.use_kernels(PlainOps())
            start = time.perf_counter()
            engine.step()
            plain.append(time.perf_counter() - start)
            model.use_kernels(fused_ops)
            start = time.perf_counter()
            engine.step()
            fused.append(time.perf_counter() - start)
        p, f = statistics.median(plain) * 1000, statistics.median(fused) * 1000
        print(f"| {batch} | ~{len(prompt) + 30} | {p:.1f} ms | {f:.1f} ms | {p / f:.2f}x |")


if __name__ == "__main__":
    main()
