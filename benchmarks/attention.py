"""Time decode attention at SmolLM2's head layout: CPU SDPA vs grouped matmuls.

    .venv/bin/python benchmarks/attention.py

The measurement behind inferd.layers.attention's choice of kernel for batched decodes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from inferd.layers.attention import grouped_attention

HEADS, KV_HEADS, DIM = 9, 3, 64


def bench(fn: Callable[[], object], n: int = 200) -> float:
    for _ in range(10):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    print("| decodes | context | SDPA | grouped matmuls |")
    print("|---|---|---|---|")
    with torch.inference_mode():
        for batch, length in ((1, 64), (4, 64), (16, 64), (16, 256), (16, 1024)):
            q = torch.randn(batch, HEADS, 1, DIM).bfloat16()
            k = torch.randn(batch, KV_HEADS, length, DIM).bfloat16()
            v = torch.randn(batch, KV_HEADS, length, DIM).bfloat16()

            def sdpa(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> object:
                return F.scaled_dot_product_attention(q, k, v, scale=0.125, enable_gqa=True)

            def grouped(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> object:
                return grouped_attention(q, k, v, None, 0.125)

            print(f"| {batch} | {length} | {bench(sdpa):.0f} us | {bench(grouped):.0f} us |")


if __name__ == "__main__":
    main()
