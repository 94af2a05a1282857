"""Time the fused one-query decode attention: one task per query head (each reads its KV head's
rows on its own) against one task per (KV head, chunk of keys) for the whole group.

    PYTHONPATH=. .venv/bin/python benchmarks/kernels_attention.py [--threads N]

Run it on an idle machine: where other processes hold the cores, OpenMP's threads wait out
their time slices and both kernels measure the scheduler. Prints microseconds per call (best of a
few runs) at 32/8 heads of 128 (Llama-3-8B-like) and
SmolLM2's 9/3 heads of 64, for 1 and 4 sequences of 512 and 4096 keys, float32 and bf16.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

from inferd.kernels import _load_once, kernel_isa
from inferd.kernels.fused import CompiledKernels

BLOCK = 16
CASES = [(32, 8, 128), (9, 3, 64)]


def best_us(fn: Callable[[], object], runs: int = 5, calls: int = 10) -> float:
    fn()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    compiled = _load_once()
    assert compiled is not None, "the fused kernels did not build"
    isa = kernel_isa()
    print(f"{isa.name if isa else 'baseline'} build, {torch.get_num_threads()} threads")
    print("| heads/kv x dim | dtype | seqs x keys | per query head (us) | grouped (us) | ratio |")
    print("|---|---|---|---|---|---|")
    for heads, kv_heads, dim in CASES:
        for dtype in (torch.float32, torch.bfloat16):
            for batch, keys in ((1, 512), (1, 4096), (4, 512), (4, 4096)):
                old, new = (
                    time_case(compiled, heads, kv_heads, dim, dtype, batch, keys, grouped)
                    for grouped in (False, True)
                )
                print(
                    f"| {heads}/{kv_heads} x {dim} | {str(dtype)[6:]} | {batch} x {keys} "
                    f"| {old:.0f} | {new:.0f} | {new / old:.2f} |",
                    flush=True,
                )


def time_case(
    compiled: CompiledKernels,
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    batch: int,
    keys: int,
    grouped: bool,
) -> float:
    blocks = keys // BLOCK
    k = torch.randn(batch * blocks, BLOCK, kv_heads, dim).to(dtype)
    v = torch.randn_like(k)
    q = torch.randn(batch, heads, dim).to(dtype)
    tables = torch.arange(batch * blocks).view(batch, blocks)
    lens = torch.full((batch,), keys)
    args = (q, k, v, tables, lens, dim**-0.5, 0.0, 0, grouped)
    return best_us(functools.partial(compiled.decode_attention, *args))


if __name__ == "__main__":
    main()
