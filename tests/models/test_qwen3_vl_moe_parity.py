"""Our Qwen3-VL-MoE (Qwen3-VL's code, its sparse layers' MLPs a mixture of experts,
layers/moe.py) against transformers on the tiny random checkpoint (f32; tests/models/
tiny_qwen3_vl.py): the config read from it, the logits of every position for text alone, an
image, a video and both, and greedy tokens. The routing really routes: top-1 routing, or the
top-2 weights left unnormalized, move the logits far past the tolerance. The experts also load
from the layout transformers 4 saved them in (each matrix transposed), as the published
checkpoints hold them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import inferd.layers.moe
from inferd.layers.moe import SparseMoeBlock
from inferd.loading.hf_model import load_safetensors_model
from inferd.loading.hf_processor import read_qwen3_video_config, read_visual_configs
from inferd.models.config import ModelConfigError, config_from_hf
from inferd.models.llama import LlamaMLP
from inferd.models.qwen3_vl import Qwen3VLForCausalLM
from inferd.models.qwen3_vl_video import Qwen3VideoConfig
from tests.models.paged import paged_logits
from tests.models.test_qwen3_vl_parity import (
    Setup,
    assert_greedy_tokens_match,
    case_inputs,
    our_inputs,
    reference,
)

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
    model = ours[0]
    _, hf, processor = tiny
    ids, prepared = case_inputs(case, ours, processor, video_cfg)
    with torch.inference_mode():
        ref = hf(**reference(hf, ids, prepared)).logits[0]
    embeds, positions = our_inputs(model, ids, prepared)
    return paged_logits(model, ids, embeds, positions=positions), ref


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
