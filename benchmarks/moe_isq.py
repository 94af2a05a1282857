"""Time a mixture-of-experts block (layers/moe.py) with its experts dense and quantized.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/moe_isq.py [--rows 1,256] [--reps 9]

Qwen3-VL-MoE's sparse block at hidden 2048, 32 experts of 768 (Qwen3-VL-30B-A3B's expert
width), 8 a token, in bf16, its experts held four ways, as a load leaves them:

- ``bf16 dense``: the dense weight alone (every row through oneDNN's bf16 matmul);
- ``bf16``: a bf16 load without --isq: the dense weight and its packed int8 copy for small
  batches (``Linear.pack``, the VNNI kernel where it runs), each expert choosing by the rows
  routed to it;
- ``q8`` / ``q4``: ``--isq``: each expert's projections quantized (``Isq.apply``), the packed
  kernels serving every row, the dense weight dropped.

Prints the milliseconds of one block call per batch size (the least of ``--reps``, the variants
interleaved call by call so a loaded machine's drift hits all alike; the same rows and routing
for all) and the bytes each variant's experts hold (``resident_bytes``: weights and packed
copies).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from inferd.kernels import load_ops
from inferd.layers.kernel_user import KernelUser
from inferd.layers.linear import PackedKind, resident_bytes
from inferd.layers.moe import SparseMoeBlock
from inferd.loading.quantize import Isq, linear_modules

HIDDEN, EXPERTS, TOP_K, WIDTH = 2048, 32, 8, 768


def blocks() -> dict[str, SparseMoeBlock]:
    """The block's four variants, on the same random weights (float32 sources, as a load
    reads them)."""
    g = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        dense = SparseMoeBlock(HIDDEN, EXPERTS, TOP_K, WIDTH, gelu=False)
    dense.to_empty(device="cpu")
    sources: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in dense.named_parameters():
            sources[name] = torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5
            p.copy_(sources[name])
    dense = dense.bfloat16()
    made = {"bf16 dense": dense}
    for variant in ("bf16", "q8", "q4"):
        block = copy.deepcopy(dense)
        for name, layer in linear_modules(block):
            source = sources[name + ".weight"]
            if variant == "bf16":
                layer.pack(PackedKind.INT8, source=source)
            else:
                Isq(variant).apply(name, layer, source)
        made[variant] = block
    ops = load_ops(torch.bfloat16)
    for block in made.values():
        for module in block.modules():
            if isinstance(module, KernelUser):
                module.ops = ops
    return made


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,256")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=0, help="torch's threads (0: as set)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    made = blocks()
    kernels = load_ops(torch.bfloat16).description
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {kernels}")
    print(f"hidden {HIDDEN}, {EXPERTS} experts of {WIDTH}, top {TOP_K}")
    print("| rows | " + " | ".join(f"{v} ms" for v in made) + " |")
    print("|---|" + "---|" * len(made))
    with torch.inference_mode():
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows))
            x = x.bfloat16()
            best = dict.fromkeys(made, float("inf"))
            for block in made.values():
                block(x)  # warm: oneDNN's packed copies, the kernels' first calls
            for _ in range(args.reps):
                for variant, block in made.items():
                    start = time.perf_counter()
                    block(x)
                    best[variant] = min(best[variant], time.perf_counter() - start)
            print(f"| {rows} | " + " | ".join(f"{best[v] * 1e3:.2f}" for v in made) + " |")
    print(
        "| experts' MiB | "
        + " | ".join(f"{resident_bytes(block.experts) / 2**20:.0f}" for block in made.values())
        + " |"
    )


if __name__ == "__main__":
    main()
