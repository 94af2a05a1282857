"""LoRA adapters against transformers + peft: logits on a tiny random Llama and on the real
SmolLM2, for every target."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from inferd.layers.lora import lora_rows
from inferd.loading.gguf import GGUFFile
from inferd.loading.gguf_model import load_gguf_model
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


SMOLLM2_PROMPT = (
    "<|im_start|>user\nWrite a haiku about a lighthouse.<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.mark.parametrize("rank", [8, 64])
def test_smollm2_logits_match_peft(
    tmp_path: Path, rank: int, smollm2_gguf: Path, hf_smollm2: Any, hf_smollm2_tokenizer: Any
) -> None:
    """A random adapter on all seven projections of the real SmolLM2 (its GGUF dequantized to
    f32, as transformers reads it): our logits are transformers + peft's."""
    hf = copy.deepcopy(hf_smollm2)  # peft wraps the model it gets; the session's stays plain
    peft_model = save_random_adapter(hf, tmp_path / "ad", rank, seed=100 + rank)
    ids = hf_smollm2_tokenizer(SMOLLM2_PROMPT)["input_ids"]
    ref = _hf_logits(peft_model, ids)
    assert (ref - _hf_logits(hf_smollm2, ids)).abs().max() > 0.1  # the adapter matters

    model = load_gguf_model(GGUFFile(smollm2_gguf), torch.float32, progress=False)[0]
    adapter = read_adapter("ad", tmp_path / "ad", model)
    attach(model, adapter)
    with lora_rows([adapter.key] * len(ids)):
        ours = full_forward(model, ids)
    # Measured ~5e-5 at both ranks (logits up to ~37): within 1e-4, absolute.
    assert (ours - ref).abs().max() <= 1e-4
