"""Time the int4 x int8 (VNNI) kernel against oneDNN's packed dense bf16 and torch's int4 kernel.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/int4_int8.py [--rows 1,2,4,8,16,32,64]

At SmolLM2-135M's projection shapes, each with 30 weights of its own (one per layer, as in the
model, so a pass streams them as a decode step does), prints the milliseconds of one pass over
the 30 layers per kernel and batch size, the least of ``--reps`` passes, with the kernels
interleaved pass by pass so a loaded machine's drift hits all alike.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from inferd.kernels import load_ops
from inferd.layers.linear import Linear, PackedKind, pack_int4_vnni

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30

Kernel = Callable[[torch.Tensor], torch.Tensor]


def kernels_for(out_f: int, in_f: int) -> dict[str, list[Kernel]]:
    ops = load_ops(torch.bfloat16)
    made: dict[str, list[Kernel]] = {"onednn bf16": [], "torch int4": [], "int4 x int8": []}
    for _ in range(LAYERS):
        w = torch.randn(out_f, in_f) * 0.02
        dense = Linear(in_f, out_f).bfloat16()
        dense.weight.data.copy_(w)
        dense.small_batch = 0  # always the dense (oneDNN-packed) weight
        int4 = Linear(in_f, out_f).bfloat16()
        int4.pack(PackedKind.INT4, source=w, small_batch=1 << 20)
        packed, sm = pack_int4_vnni(w)
        made["onednn bf16"].append(dense)
        made["torch int4"].append(int4)
        made["int4 x int8"].append(
            lambda x, p=packed, s=sm: ops.int4_vnni_linear(x, p, s, out_f)  # type: ignore[misc]
        )
    return made


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch's threads (0: as set)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| shape | rows | onednn bf16 | torch int4 | int4 x int8 | bf16 / int4xint8 |")
    print("|---|---|---|---|---|---|")
    with torch.no_grad():
        for name, (out_f, in_f) in SHAPES.items():
            made = kernels_for(out_f, in_f)
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(rows, in_f).bfloat16()
                times: dict[str, list[float]] = {k: [] for k in made}
                for rep in range(args.reps + 1):
                    for kind, fns in made.items():
                        t = time.perf_counter()
                        for fn in fns:
                            fn(x)
                        if rep:  # the first pass warms up (packs oneDNN's copies)
                            times[kind].append((time.perf_counter() - t) * 1000)
                # The least of the passes: on a shared machine the median of short passes
                # measures the scheduler (a descheduled thread stalls a whole pass).
                med = {k: min(v) for k, v in times.items()}
                ratio = med["onednn bf16"] / med["int4 x int8"]
                cells = " | ".join(f"{v:.2f}" for v in med.values())
                print(f"| {name} {out_f}x{in_f} | {rows} | {cells} | {ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
