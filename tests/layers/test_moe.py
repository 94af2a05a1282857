"""The mixture-of-experts layer (layers/moe.py) against transformers' own blocks, on the same
random weights: Qwen3-VL-MoE's sparse block (router and experts) and Gemma 4's experts given
float32 routing weights, each with transformers' eager experts (the loop over experts the layer
follows). In float32 and in bf16, where the routing weights' rounding (to bf16 before the
experts scale by them, or not) shows in the bits. Quantized (ISQ), the experts compute what
their quantized weights dequantized would, and the routing keeps its bits."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from inferd.layers.linear import PackedKind
from inferd.layers.moe import Experts, SparseMoeBlock, top_k_routing
from inferd.loading.quantize import Isq, linear_modules, quantize_weight

HIDDEN, FF, EXPERTS, TOP_K, ROWS = 64, 24, 8, 3, 37


def qwen_block() -> tuple[Any, SparseMoeBlock]:
    from transformers import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
        Qwen3VLMoeTextSparseMoeBlock,
    )

    config = Qwen3VLMoeTextConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=FF,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
    )
    config._experts_implementation = "eager"
    theirs = Qwen3VLMoeTextSparseMoeBlock(config)
    ours = SparseMoeBlock(HIDDEN, EXPERTS, TOP_K, FF, gelu=False)
    randomize(theirs, 0)
    ours.load_state_dict(per_expert(theirs.state_dict()))
    return theirs, ours


def per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' expert stacks (``experts.gate_up_proj`` [experts, out, in]) as our experts'
    projections (``experts.gate_up_proj.3.weight``), the rest as it is."""
    out = {}
    for name, t in state.items():
        if name.endswith(("gate_up_proj", "down_proj")):
            out |= {f"{name}.{e}.weight": matrix for e, matrix in enumerate(t)}
        else:
            out[name] = t
    return out


def randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 2 / p.shape[-1] ** 0.5)


def rows(dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen_block_matches_transformers(dtype: torch.dtype) -> None:
    theirs, ours = qwen_block()
    theirs, ours = theirs.to(dtype), ours.to(dtype)
    x = rows(dtype)
    with torch.no_grad():
        _, ref_weights, ref_experts = theirs.gate(x)
        weights, experts = ours.gate(x)
        expected, out = theirs(x[None])[0], ours(x)
    assert torch.equal(experts, ref_experts) and weights.dtype == ref_weights.dtype == dtype
    assert torch.equal(weights, ref_weights)
    # Every expert gets rows: the gather, the scatter and the order of the adds all count.
    assert set(experts.flatten().tolist()) == set(range(EXPERTS))
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_with_float32_weights_match_gemma4s(dtype: torch.dtype) -> None:
    """Gemma 4's routing weights stay float32: each expert's rows are scaled in float32 and
    rounded once, which in bf16 differs from rounding the weights first."""
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts

    config = Gemma4TextConfig(
        hidden_size=HIDDEN, moe_intermediate_size=FF, num_experts=EXPERTS, top_k_experts=TOP_K
    )
    config._experts_implementation = "eager"
    theirs = Gemma4TextExperts(config)
    ours = Experts(EXPERTS, HIDDEN, FF, gelu=True)
    randomize(theirs, 2)
    ours.load_state_dict(per_expert(theirs.state_dict()))
    theirs, ours = theirs.to(dtype), ours.to(dtype)
    x = rows(dtype, seed=3)
    logits = torch.randn(ROWS, EXPERTS, generator=torch.Generator().manual_seed(4))
    weights, experts = top_k_routing(logits, TOP_K)
    with torch.no_grad():
        expected, out = theirs(x, experts, weights), ours(x, weights, experts)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    if dtype == torch.bfloat16:  # rounding the weights first would have shown
        rounded = ours(x, weights.to(dtype), experts)
        assert not torch.equal(rounded, expected)


def test_routing_renormalizes_the_top_k() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 0.5]])
    weights, experts = top_k_routing(logits, 2)
    assert experts.tolist() == [[0, 1], [2, 3]]
    probs = logits.softmax(-1)
    assert torch.allclose(weights[0], probs[0, :2] / probs[0, :2].sum())
    assert torch.allclose(weights.sum(-1), torch.ones(2))


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), 0).item()


@pytest.mark.parametrize("method", ["q8", "q4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_experts_compute_their_weights_dequantized(
    method: str, dtype: torch.dtype
) -> None:
    """Every expert's projections quantized as ISQ quantizes any projection (``Isq.apply``, the
    packed kernels serving every row) against the block whose experts hold those weights
    dequantized (``QuantizedWeight.dequantize``, the reference path): within the bound ISQ's
    dense projections are held to (tests/test_quantize.py: cosine 0.9995, only the kernels'
    bf16 arithmetic differs). The router is untouched: the same experts, the same weights."""
    _, dense = qwen_block()
    dense = dense.to(dtype)
    quantized, reference = copy.deepcopy(dense), copy.deepcopy(dense)
    isq = Isq(method)
    experts = list(linear_modules(quantized))
    assert len(experts) == 2 * EXPERTS  # the router is no projection: it stays as it is
    with torch.no_grad():
        for name, layer in experts:
            weight = layer.weight.float()
            isq.apply(name, layer, weight)
            dequantized = quantize_weight(weight, isq.kind).dequantize()
            reference.get_submodule(name).weight.copy_(dequantized)
    # q4: gate_up [48, 64] takes int4; down [64, 24] is no whole group of 32, so int8
    expected_kinds = {PackedKind.INT8} if method == "q8" else {PackedKind.INT4, PackedKind.INT8}
    assert {layer.packed_kind for _, layer in experts} == expected_kinds
    assert not any(layer.dense for _, layer in experts)
    x = rows(dtype, seed=5)
    with torch.no_grad():
        routing, expected_routing = quantized.gate(x), dense.gate(x)
        got, expected, unquantized = quantized(x), reference(x), dense(x)
    assert all(torch.equal(a, b) for a, b in zip(routing, expected_routing, strict=True))
    assert got.dtype == dtype
    assert _cosine(got, expected) > 0.9995
    # the bound tells a quantized expert from a dense one: the quantization error is larger
    assert _cosine(got, expected) > _cosine(got, unquantized)
