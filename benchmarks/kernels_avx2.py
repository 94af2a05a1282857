"""Time a float32 decode step's linears at SmolLM2-135M's shapes on the kernels' build: dense
float32 against inferd's weight-only int4 (row layout) and int8 kernels.

    INFERD_KERNEL_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 PYTHONPATH=. .venv/bin/python \\
        benchmarks/kernels_avx2.py [--threads N] [--decode]

(the two variables run an AVX-512 machine as an AVX2 one: inferd's kernels and torch's own
dispatch). Prints the best of a few runs, in milliseconds per step (30 layers + the output head,
every layer its own weights), per batch size; torch's own weight-only kernels with float32
activations are shown for one row (they are ~10x slower than dense, which is why float32 models
pack in inferd's layouts). ``--decode``: SmolLM2's single-stream tokens/s, dense against packed
(the prompt, 6 tokens, is included).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from inferd.kernels import kernel_isa, load_ops
from inferd.layers.linear import pack_int4, pack_int4_rows, pack_int8

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def best_ms(step: Callable[[], object], runs: int = 7) -> float:
    step()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--decode", action="store_true", help="SmolLM2 tokens/s instead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.decode:
        decode_tokens_per_s()
        return
    ops = load_ops(torch.float32)
    isa = kernel_isa()
    print(
        f"{ops.description}, {isa.name if isa else 'baseline'} build; torch capability "
        f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads"
    )
    torch.manual_seed(0)
    weights = [torch.randn(out, k) * 0.02 for out, k in SHAPES]
    int4 = [pack_int4_rows(w) for w in weights]
    int8 = [pack_int8(w, torch.float32) for w in weights]
    print("| batch | f32 dense | int4 (inferd) | int8 (inferd) |")
    print("|---|---|---|---|")
    for batch in (1, 2, 4, 8):
        xs = {k: torch.randn(batch, k) for k in (576, 1536)}
        dense = best_ms(partial(run, F.linear, xs, [(w,) for w in weights]))
        i4 = best_ms(partial(run, ops.int4_rows_linear, xs, int4))
        i8 = best_ms(partial(run, ops.int8_linear, xs, int8))
        print(f"| {batch} | {dense:.1f} | {i4:.1f} | {i8:.1f} |", flush=True)
    xs = {k: torch.randn(1, k) for k in (576, 1536)}
    torch4 = [(*pack_int4(w, torch.float32), w.shape[1]) for w in weights]
    slow = best_ms(partial(run, torch_int4, xs, torch4), runs=2)
    print(f"torch's int4 kernel, float32 activations, 1 row: {slow:.1f} ms")


def decode_tokens_per_s(new_tokens: int = 32) -> None:
    """SmolLM2's greedy single-stream decode (best of 3), dense f32 against the packed copies."""
    from inferd import LLM, SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for packed in (False, True):
        llm = LLM("smollm2", dtype="auto", packed_kernels=packed)
        llm.generate("Hi", SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            llm.generate("The capital of France is", params, use_tqdm=False)
            best = min(best, time.perf_counter() - start)
        kind = "packed int4/int8" if packed else "dense"
        print(f"{llm.model.dtype} {kind}: {new_tokens / best:.1f} tokens/s", flush=True)
        llm.model.shutdown()


def run(
    kernel: Callable[..., torch.Tensor], xs: dict[int, torch.Tensor], layers: list[tuple[Any, ...]]
) -> None:
    """One step: every layer's kernel on the activation row(s) of its input width."""
    for args in layers:
        kernel(xs[in_features(args)], *args)


def in_features(args: tuple[Any, ...]) -> int:
    first = args[0]  # a dense weight [out, in], packed int4 [out, in/2] or int8 [out, in]
    if len(args) == 3:  # torch's int4 pack: its width rides along
        return int(args[2])
    return int(first.shape[1] * 2 if first.dtype == torch.uint8 else first.shape[1])


def torch_int4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, _: int) -> torch.Tensor:
    return torch._weight_int4pack_mm_for_cpu(x, packed, 32, scales)


if __name__ == "__main__":
    main()
