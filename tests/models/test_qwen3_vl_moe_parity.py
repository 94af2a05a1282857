"""Our Qwen3-VL-MoE (Qwen3-VL's code, its sparse layers' MLPs a mixture of experts,
layers/moe.py) against transformers on the tiny random checkpoint (f32; tests/models/
tiny_qwen3_vl.py): the config read from it, the logits of every position for text alone, an
image, a video and both, and greedy tokens. The routing really routes: top-1 routing, or the
top-2 weights left unnormalized, move the logits far past the tolerance. The experts also load
from the layout transformers 4 saved them in (each matrix transposed), as the published
checkpoints hold them. Under ``--isq`` the experts are quantized as every other projection: q8's
logits stay within ISQ's dense bounds (tests/test_quantize.py) of float32 and of the model whose
quantized weights are dequantized, and a store entry (``inferd quantize``, with an importance
matrix collected per expert or without) loads the same logits as quantizing in situ."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import inferd.layers.moe
from inferd.layers.linear import PackedKind
from inferd.layers.moe import SparseMoeBlock
from inferd.loading.calibration import compute_imatrix
from inferd.loading.hf_model import load_safetensors_model
from inferd.loading.hf_processor import read_qwen3_video_config, read_visual_configs
from inferd.loading.imatrix import Imatrix
from inferd.loading.model import load
from inferd.loading.quantize import Isq, isq_for, linear_modules, quantize_weight
from inferd.models.config import ModelConfigError, config_from_hf
from inferd.models.llama import LlamaMLP
from inferd.models.qwen3_vl import Qwen3VLForCausalLM
from inferd.models.qwen3_vl_video import Qwen3VideoConfig
from inferd.quantize_tool import quantize_to_store
from inferd.source import resolve_source
from tests.models.paged import paged_logits
from tests.models.test_qwen3_vl_parity import (
    Setup,
    assert_greedy_tokens_match,
    case_inputs,
    our_inputs,
    reference,
)
from tests.models.tiny import CORPUS

Tiny = tuple[Path, Any, Any]
LOGIT_TOLERANCE = 1e-4  # float32 on both sides: only summation order differs
CASES = ["text only", "one image", "one video", "video and image"]


@pytest.fixture(scope="module")
def ours(tiny_qwen3_vl_moe: Tiny) -> Setup:
    model, cfg = load_safetensors_model(tiny_qwen3_vl_moe[0], torch.float32, progress=False)
    assert isinstance(model, Qwen3VLForCausalLM)
    configs = read_visual_configs(tiny_qwen3_vl_moe[0], cfg)
    assert configs is not None
    return model, configs[0], configs[1]


@pytest.fixture(scope="module")
def video_cfg(tiny_qwen3_vl_moe: Tiny) -> Qwen3VideoConfig:
    cfg = config_from_hf(json.loads((tiny_qwen3_vl_moe[0] / "config.json").read_text()))
    found = read_qwen3_video_config(tiny_qwen3_vl_moe[0], cfg)
    assert found is not None
    return found


def test_config_reads_the_experts(tiny_qwen3_vl_moe: Tiny, ours: Setup) -> None:
    hf = json.loads((tiny_qwen3_vl_moe[0] / "config.json").read_text())
    assert hf["model_type"] == "qwen3_vl_moe"
    cfg = config_from_hf(hf)
    assert cfg.architecture == "qwen3_vl" and cfg.moe is not None
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size) == (4, 2, 24)
    assert cfg.moe.layers == (0, 2)  # layer 1 is in mlp_only_layers
    model = ours[0]
    kinds = [type(layer.mlp) for layer in model.layers]  # type: ignore[union-attr]
    assert kinds == [SparseMoeBlock, LlamaMLP, SparseMoeBlock]
    model.lora_target(1, "gate_proj")  # a dense layer's MLP takes an adapter
    with pytest.raises(ModelConfigError, match="mixture of experts"):
        model.lora_target(0, "gate_proj")


def logits_and_reference(
    case: str, ours: Setup, tiny: Tiny, video_cfg: Qwen3VideoConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    _, hf, processor = tiny
    ids, prepared = case_inputs(case, ours, processor, video_cfg)
    with torch.inference_mode():
        ref = hf(**reference(hf, ids, prepared)).logits[0]
    return logits_of(ours[0], case, ours, tiny, video_cfg), ref


def logits_of(
    model: Qwen3VLForCausalLM, case: str, ours: Setup, tiny: Tiny, video_cfg: Qwen3VideoConfig
) -> torch.Tensor:
    """``model``'s logits of every position of ``case``."""
    ids, prepared = case_inputs(case, ours, tiny[2], video_cfg)
    embeds, positions = our_inputs(model, ids, prepared)
    return paged_logits(model, ids, embeds, positions=positions)


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(
    case: str, ours: Setup, tiny_qwen3_vl_moe: Tiny, video_cfg: Qwen3VideoConfig
) -> None:
    logits, ref = logits_and_reference(case, ours, tiny_qwen3_vl_moe, video_cfg)
    assert (logits - ref).abs().max() <= LOGIT_TOLERANCE


def unnormalized(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.topk(logits.float().softmax(-1), top_k, dim=-1)


@pytest.mark.parametrize("fault", ["top-1", "unnormalized"])
def test_wrong_routing_moves_the_logits(
    fault: str,
    ours: Setup,
    tiny_qwen3_vl_moe: Tiny,
    video_cfg: Qwen3VideoConfig,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The parity above would catch a router that picks one expert, or one that leaves the
    top-2 weights as they come from the softmax."""
    if fault == "top-1":
        for layer in ours[0].layers:
            if isinstance(layer.mlp, SparseMoeBlock):  # type: ignore[union-attr]
                monkeypatch.setattr(layer.mlp.gate, "top_k", 1)  # type: ignore[union-attr]
    else:
        monkeypatch.setattr(inferd.layers.moe, "top_k_routing", unnormalized)
    logits, ref = logits_and_reference("one image", ours, tiny_qwen3_vl_moe, video_cfg)
    assert (logits - ref).abs().max() > 100 * LOGIT_TOLERANCE


@pytest.mark.parametrize("case", ["text only", "video and image"])
def test_greedy_tokens_match_transformers(
    case: str, ours: Setup, tiny_qwen3_vl_moe: Tiny, video_cfg: Qwen3VideoConfig
) -> None:
    assert_greedy_tokens_match(case, ours, tiny_qwen3_vl_moe, video_cfg)


def test_experts_saved_transposed_load_the_same(
    tiny_qwen3_vl_moe: Tiny, ours: Setup, tmp_path: Path
) -> None:
    """transformers 4 kept each expert's matrices as [in, out] (Qwen/Qwen3-VL-30B-A3B's
    safetensors hold ``gate_up_proj`` [128, 2048, 1536]); those load as the fused [out, in]."""
    for f in tiny_qwen3_vl_moe[0].iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, tmp_path / f.name)
    tensors = load_file(tiny_qwen3_vl_moe[0] / "model.safetensors")
    experts = [n for n in tensors if ".experts." in n]
    assert len(experts) == 4  # gate_up_proj and down_proj of layers 0 and 2
    save_file(
        {n: t.transpose(1, 2).contiguous() if n in experts else t for n, t in tensors.items()},
        tmp_path / "model.safetensors",
        metadata={"format": "pt"},
    )
    model, _ = load_safetensors_model(tmp_path, torch.float32, progress=False)
    expected = dict(ours[0].named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, expected[name]), name


# -- quantized (--isq) ----------------------------------------------------------------------------
EXPERT_PROJECTIONS = 2 * 2 * 4  # gate_up and down, in layers 0 and 2, of 4 experts


def load_isq(directory: Path, isq: Isq) -> Qwen3VLForCausalLM:
    model, _ = load_safetensors_model(directory, torch.float32, progress=False, isq=isq)
    assert isinstance(model, Qwen3VLForCausalLM)
    return model


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()


@pytest.fixture(scope="module")
def q8(tiny_qwen3_vl_moe: Tiny) -> Qwen3VLForCausalLM:
    return load_isq(tiny_qwen3_vl_moe[0], Isq("q8"))


@pytest.mark.parametrize("case", ["text only", "one image"])
def test_isq_q8_quantizes_the_experts_within_the_dense_bounds(
    case: str,
    ours: Setup,
    q8: Qwen3VLForCausalLM,
    tiny_qwen3_vl_moe: Tiny,
    video_cfg: Qwen3VideoConfig,
) -> None:
    """The bounds tests/test_quantize.py holds ISQ's dense projections to: cosine 0.99 to the
    float32 logits (q8), 0.9995 to the model holding the quantized weights dequantized. The
    routers stay as they were."""
    experts = [(n, layer) for n, layer in linear_modules(q8) if ".experts." in n]
    assert len(experts) == EXPERT_PROJECTIONS
    assert all(layer.packed_kind is PackedKind.INT8 and not layer.dense for _, layer in experts)
    for i in (0, 2):
        mine, theirs = q8.layers[i].mlp, ours[0].layers[i].mlp  # type: ignore[union-attr]
        assert torch.equal(mine.gate.weight, theirs.gate.weight)  # type: ignore[union-attr]
    dequantized, _ = load_safetensors_model(tiny_qwen3_vl_moe[0], torch.float32, progress=False)
    assert isinstance(dequantized, Qwen3VLForCausalLM)
    with torch.no_grad():  # every projection ISQ quantized holds its weight dequantized
        for name, layer in linear_modules(dequantized):
            if not q8.get_submodule(name).dense:
                layer.weight.copy_(quantize_weight(layer.weight, PackedKind.INT8).dequantize())
    got = logits_of(q8, case, ours, tiny_qwen3_vl_moe, video_cfg)
    f32 = logits_of(ours[0], case, ours, tiny_qwen3_vl_moe, video_cfg)
    expected = logits_of(dequantized, case, ours, tiny_qwen3_vl_moe, video_cfg)
    assert cosine(got, expected) > 0.9995  # only the kernels' bf16 arithmetic differs
    assert cosine(got, f32) > 0.99


@pytest.fixture(scope="module")
def imatrix(tiny_qwen3_vl_moe: Tiny) -> Imatrix:
    """The tiny model's importance matrix from the corpus: each expert's statistics from the
    rows routed to it."""
    loaded = load(str(tiny_qwen3_vl_moe[0]), dtype="f32", packed_kernels=False, progress=False)
    return compute_imatrix(
        loaded.model, loaded.tokenizer, " ".join(CORPUS), chunk_size=32, progress=False
    )


@pytest.mark.parametrize("method", ["q8", "q4"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
def test_a_store_entry_loads_the_logits_of_isq(
    method: str,
    weighted: bool,
    ours: Setup,
    imatrix: Imatrix,
    tiny_qwen3_vl_moe: Tiny,
    video_cfg: Qwen3VideoConfig,
    tmp_path: Path,
) -> None:
    """``inferd quantize`` keeps every expert's projections (quantized for the importance
    matrix, where given); a load under --isq reads them from the entry and computes the logits
    of quantizing in situ, bit for bit."""
    matrix = imatrix if weighted else None
    source = resolve_source(str(tiny_qwen3_vl_moe[0]))
    _, _, made = quantize_to_store(source, method, imatrix=matrix, home=tmp_path, progress=False)
    experts = {n for n in made.quantized if ".experts." in n}
    assert len(experts) == EXPERT_PROJECTIONS
    if matrix is not None:  # each expert the corpus reached is quantized for its own rows
        reached = {n for n in experts if matrix.counts.get(n, 0) > 0}
        assert reached and reached <= made.weighted
        name = sorted(reached)[0]
        importance = matrix.importance(name)
        assert importance is not None
        source_weight = ours[0].get_submodule(name).weight
        weight = made.quantized[name].dequantize()
        kind = made.quantized[name].kind
        assert torch.equal(weight, quantize_weight(source_weight, kind, importance).dequantize())
        assert not torch.equal(weight, quantize_weight(source_weight, kind).dequantize())
    stored = isq_for(method, source.digest, tmp_path, matrix)
    assert stored is not None and experts <= set(stored.stored)
    in_situ = load_isq(tiny_qwen3_vl_moe[0], Isq(method, imatrix=matrix))
    from_store = load_isq(tiny_qwen3_vl_moe[0], stored)
    for case in ("text only", "one image"):
        assert torch.equal(
            logits_of(from_store, case, ours, tiny_qwen3_vl_moe, video_cfg),
            logits_of(in_situ, case, ours, tiny_qwen3_vl_moe, video_cfg),
        )
