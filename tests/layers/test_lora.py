"""Grouped LoRA updates: each row gets its own adapter's update, the base rows none, and under
``dense_rows`` a row's bits do not depend on the rows beside it."""

from __future__ import annotations

import torch

from inferd.layers.linear import Linear, dense_rows
from inferd.layers.lora import LoraDelta, LoraSlot, lora_rows

IN, OUT, RANK = 96, 80, 8


def _layer(dtype: torch.dtype) -> tuple[Linear, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    layer = Linear(IN, OUT).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(OUT, IN, generator=g) / IN**0.5)
    weights = {}
    layer.lora = LoraSlot()
    for name, start, width in (("a", 0, OUT), ("b", 16, 32)):  # "b": a slice, like k of QKV
        a = (torch.randn(RANK, IN, generator=g) / IN**0.5).to(dtype)
        b = (torch.randn(width, RANK, generator=g) / RANK**0.5).to(dtype)
        layer.lora.put(name, LoraDelta(a, b, 2.0, start))
        weights[name] = (a, b)
    return layer, weights


def test_each_row_gets_its_adapter() -> None:
    layer, weights = _layer(torch.float32)
    x = torch.randn(5, IN, generator=torch.Generator().manual_seed(1))
    names = ["a", None, "b", "a", None]
    with torch.inference_mode():
        base = x @ layer.weight.T
        with lora_rows(names):
            got = layer(x)
    want = base.clone()
    for row, name in enumerate(names):
        if name == "a":
            a, b = weights["a"]
            want[row] += 2.0 * (x[row] @ a.T @ b.T)
        elif name == "b":
            a, b = weights["b"]
            want[row, 16:48] += 2.0 * (x[row] @ a.T @ b.T)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[1], base[1]) and torch.equal(got[4], base[4])


def test_dense_rows_are_batch_invariant() -> None:
    # bf16, as --deterministic runs: dense f32 matmuls are not batch-invariant even without
    # adapters (the guarantee is the bf16 kernel's: layers/linear.py ``dense_rows``).
    dtype = torch.bfloat16
    layer, _ = _layer(dtype)
    x = torch.randn(9, IN, generator=torch.Generator().manual_seed(2)).to(dtype)
    names = ["a", "b", "a", None, "a", "b", "a", "a", "b"]
    with torch.inference_mode(), dense_rows():
        with lora_rows(names):
            together = layer(x)
        for row, name in enumerate(names):
            with lora_rows([name]):
                assert torch.equal(layer(x[row : row + 1])[0], together[row]), row
