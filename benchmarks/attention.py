"""Time decode attention at SmolLM2's head layout: CPU SDPA vs grouped matmuls.

    .venv/bin/python benchmarks/attention.py

The measurement behind inferd.layers.attention's choice of kernel for decodes: bf16 grouped
matmuls for batches, the same in float32 for one sequence; and behind gathering the paged KV
into a contiguous tensor first (the matmuls are several times slower on the transposed view).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from inferd.kernels.plain import grouped_attention

HEADS, KV_HEADS, DIM = 9, 3, 64


def bench(fn: Callable[[], object], n: int = 200) -> float:
    for _ in range(10):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    print(
        "| decodes | context | SDPA | grouped bf16 | grouped float32 | grouped bf16, strided K/V |"
    )
    print("|---|---|---|---|---|---|")
    with torch.inference_mode():
        for batch, length in ((1, 64), (1, 256), (1, 1024), (4, 64), (16, 64), (16, 256)):
            q = torch.randn(batch, HEADS, 1, DIM).bfloat16()
            k = torch.randn(batch, KV_HEADS, length, DIM).bfloat16()
            v = torch.randn(batch, KV_HEADS, length, DIM).bfloat16()

            def sdpa(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> object:
                return F.scaled_dot_product_attention(q, k, v, scale=0.125, enable_gqa=True)

            def grouped(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> object:
                return grouped_attention(q, k, v, None, 0.125)

            def grouped32(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> object:
                return grouped_attention(q.float(), k.float(), v.float(), None, 0.125)

            # The layout a block gather yields before .contiguous(): [B, T, kv, d] transposed.
            ks, vs = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))

            def strided(q: torch.Tensor = q, k: torch.Tensor = ks, v: torch.Tensor = vs) -> object:
                return grouped_attention(q, k, v, None, 0.125)

            times = [bench(f) for f in (sdpa, grouped, grouped32, strided)]
            print(f"| {batch} | {length} | " + " | ".join(f"{t:.0f} us" for t in times) + " |")


if __name__ == "__main__":
    main()
