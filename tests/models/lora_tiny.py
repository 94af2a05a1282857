"""Random PEFT LoRA adapters on a tiny transformers model, saved as PEFT writes them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_random_adapter(
    hf: Any, directory: Path, rank: int, seed: int, *, alpha: int = 16, rslora: bool = False
) -> Any:
    """A random adapter (B != 0, so it changes the logits) on ``hf``'s seven projections, saved
    in ``directory``; returns the PEFT model (``hf`` wrapped, in eval mode)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=TARGETS,
        init_lora_weights=False,
        use_rslora=rslora,
        lora_dropout=0.0,
    )
    torch.manual_seed(seed)
    peft_model = get_peft_model(hf, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:  # large enough that a wrong scale or slice shows in the logits
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 / p.shape[-1] ** 0.5))
    # No embedding is a target: say so, rather than have peft look for the base's config.json
    # (absent beside a GGUF file) to decide it.
    peft_model.save_pretrained(str(directory), save_embedding_layers=False)
    return peft_model.eval()
