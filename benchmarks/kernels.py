"""Time the linear kernels at SmolLM2-135M's shapes: dense bf16/f32 vs weight-only int8/int4.

    .venv/bin/python benchmarks/kernels.py

Prints milliseconds per decode step spent in the linears (30 layers + the output head) for each
batch size; this is the measurement behind inferd.layers.linear's kernel switch. Every layer has
its own weights, as in the model, so each step streams them all from memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from inferd.layers.linear import Linear, PackedKind

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD = (49152, 576)
LAYERS = 30


Kernel = Callable[[torch.Tensor], torch.Tensor]


def step_ms(batch: int, make: Callable[[torch.Tensor], Kernel], n: int = 10) -> float:
    shapes = [*(s for _ in range(LAYERS) for s in SHAPES.values()), HEAD]
    calls = [
        (make(torch.randn(out, k) * 0.02), torch.randn(batch, k).bfloat16()) for out, k in shapes
    ]

    def step() -> None:
        for fn, x in calls:
            fn(x)

    step()
    t = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t) / n * 1000


def dense(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    wb = w.bfloat16()
    return lambda x: F.linear(x, wb)


def packed(kind: PackedKind) -> Callable[[torch.Tensor], Kernel]:
    def make(w: torch.Tensor) -> Kernel:
        layer = Linear(w.shape[1], w.shape[0]).bfloat16()
        layer.pack(kind, source=w, small_batch=1 << 20)
        return layer

    return make


def main() -> None:
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"cpu capability {torch.backends.cpu.get_cpu_capability()}"
    )
    print("| batch | bf16 dense | int8 weights | int4 weights |")
    print("|---|---|---|---|")
    with torch.inference_mode():
        for batch in (1, 2, 4, 8, 16, 32):
            row = [
                step_ms(batch, dense),
                step_ms(batch, packed(PackedKind.INT8)),
                step_ms(batch, packed(PackedKind.INT4)),
            ]
            print(f"| {batch} | " + " | ".join(f"{v:.1f} ms" for v in row) + " |")


if __name__ == "__main__":
    main()
