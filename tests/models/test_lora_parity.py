"""LoRA adapters against transformers + peft: logits on a tiny random Llama for every target."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from inferd.layers.lora import lora_rows
from inferd.loading.hf_model import load_safetensors_model
from inferd.loading.lora import attach, detach, read_adapter
from inferd.models.llama import LlamaForCausalLM
from tests.models.lora_tiny import save_random_adapter
from tests.models.test_llama_parity import full_forward
from tests.models.tiny import save_tiny

IDS = [(7 * i + 3) % 256 for i in range(23)]


def _hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def _ours(model: LlamaForCausalLM, adapter: str | None) -> torch.Tensor:
    with lora_rows([adapter] * len(IDS)):
        return full_forward(model, IDS, block_size=4)


@pytest.mark.parametrize("rslora", [False, True])
@pytest.mark.parametrize("rank", [8, 64])
def test_logits_match_peft(tmp_path: Path, rank: int, rslora: bool) -> None:
    hf = save_tiny("llama", tmp_path / "base")
    base_ref = _hf_logits(hf, IDS)
    peft_model = save_random_adapter(hf, tmp_path / "ad", rank, seed=rank, rslora=rslora)
    ref = _hf_logits(peft_model, IDS)
    assert (ref - base_ref).abs().max() > 0.1  # the adapter matters

    model, _ = load_safetensors_model(tmp_path / "base", torch.float32, progress=False)
    adapter = read_adapter("ad", tmp_path / "ad", model)
    attach(model, adapter)
    assert (_ours(model, adapter.key) - ref).abs().max() <= 1e-4
    assert (_ours(model, None) - base_ref).abs().max() <= 1e-4  # base rows untouched
    detach(model, adapter.key)
    assert (_ours(model, adapter.key) - base_ref).abs().max() <= 1e-4
    assert all(getattr(m, "lora", None) is None for m in model.modules())
