"""Time the fused one-query decode attention: one task per query head (each reads its KV head's
rows on its own) against one task per (KV head, chunk of keys) for the whole group.

    PYTHONPATH=. .venv/bin/python benchmarks/kernels_attention.py [--threads N]

Run it on an idle machine: where other processes hold the cores, OpenMP's threads wait out
their time slices and both kernels measure the scheduler. Prints microseconds per call (best of a
few runs) at 32/8 heads of 128 (Llama-3-8B-like) and
SmolLM2's 9/3 heads of 64, for 1 and 4 sequences of 512 and 4096 keys, float32 and bf16.

With ``--old-kernels PATH`` (a decode.cpp, e.g. ``git show main:inferd/kernels/decode.cpp``) it
times the grouped kernel built from that source against this tree's instead, calls alternating
in one process so that a loaded machine's drift hits both, over bf16 activations with bf16 and
int8 caches (16 sequences at SmolLM2's heads, 4 at Llama-3-8B's); medians and their ratio.
``--layers 30`` gives each call its own cache of a 30-layer rotation (SmolLM2's 30 layers of
16 x 256 keys are ~90 MB, past the last-level cache): the rows come from DRAM, as in a
model's step, where the weight matmuls between two layers' attention evict them.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import inferd.kernels as kernels
from inferd.kernels import _load_once, kernel_isa
from inferd.kernels.fused import CompiledKernels, FusedOps
from inferd.kernels.kv_quant import quantize_rows

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
    parser.add_argument("--old-kernels", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--layers", type=int, default=1, help="caches the calls rotate over")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.old_kernels is not None:
        compare_sources(args.old_kernels, args.rounds, args.layers)
        return
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


def built_from(source: Path) -> CompiledKernels:
    """The kernels compiled from ``source`` (cached by its digest, beside this tree's)."""
    kernels.SOURCE, kernels._tried, kernels._compiled = source, False, None
    ops = kernels.load_ops(torch.bfloat16)
    assert isinstance(ops, FusedOps), f"{source} did not build"
    return ops.compiled


MAX_CACHE_BYTES = 1 << 30
AB_CASES = [  # heads, kv heads, dim, sequences, keys
    (9, 3, 64, 16, 64),
    (9, 3, 64, 16, 256),
    (9, 3, 64, 16, 1024),
    (32, 8, 128, 4, 512),
    (32, 8, 128, 4, 4096),
]


def compare_sources(old_source: Path, rounds: int, layers: int) -> None:
    new_source = kernels.SOURCE
    builds = {"old": built_from(old_source), "new": built_from(new_source)}
    kernels.SOURCE, kernels._tried, kernels._compiled = new_source, False, None
    print(
        f"grouped decode attention, {torch.get_num_threads()} threads, bf16 activations, "
        f"{layers} cache(s) in rotation"
    )
    print("Medians and, after them, bests of the rounds (the best is the least disturbed by other")
    print("processes on a loaded machine).")
    print("| heads/kv x dim | cache | seqs x keys | old (us) | new (us) | new/old | best old/new |")
    print("|---|---|---|---|---|---|---|")
    for heads, kv_heads, dim, batch, keys in AB_CASES:
        if layers * 2 * (4 * batch * keys) * kv_heads * dim * 2 > MAX_CACHE_BYTES:
            continue  # the rotation's caches would not fit beside the other processes
        for cache in ("bf16", "int8"):
            call = ab_case(heads, kv_heads, dim, batch, keys, cache == "int8", layers)
            times: dict[str, list[float]] = {"old": [], "new": []}
            outs = {name: call(build) for name, build in builds.items()}
            torch.testing.assert_close(outs["new"], outs["old"], atol=2e-2, rtol=2e-2)
            for _ in range(rounds):
                for name, build in builds.items():
                    runs = functools.partial(call, build)
                    times[name].append(best_us(runs, runs=1, calls=max(1, 10 // layers)) / layers)
            old, new = (statistics.median(times[name]) for name in ("old", "new"))
            best_old, best_new = (min(times[name]) for name in ("old", "new"))
            print(
                f"| {heads}/{kv_heads} x {dim} | {cache} | {batch} x {keys} "
                f"| {old:.0f} | {new:.0f} | {new / old:.2f} "
                f"| {best_old:.0f} / {best_new:.0f} = {best_new / best_old:.2f} |",
                flush=True,
            )


def ab_case(
    heads: int, kv_heads: int, dim: int, batch: int, keys: int, int8: bool, layers: int
) -> Callable[[CompiledKernels], torch.Tensor]:
    """A call over each of ``layers`` caches (blocks shuffled over a pool of 4x the live ones,
    as a served cache's are); it returns the first cache's output."""
    torch.manual_seed(0)
    blocks = keys // BLOCK
    pool = 4 * batch * blocks
    caches = []
    for _ in range(layers):
        k = torch.randn(pool, BLOCK, kv_heads, dim).to(torch.bfloat16)
        v = torch.randn_like(k)
        caches.append((quantize_rows(k), quantize_rows(v)) if int8 else (k, v))
    q = torch.randn(batch, heads, dim).to(torch.bfloat16)
    tables = torch.randperm(pool)[: batch * blocks].view(batch, blocks)
    lens = torch.full((batch,), keys)

    def call(build: CompiledKernels) -> torch.Tensor:
        outs = [
            build.decode_attention(q, k, v, tables, lens, dim**-0.5, 0.0, 0, True)
            for k, v in caches
        ]
        return outs[0]

    return call


if __name__ == "__main__":
    main()
