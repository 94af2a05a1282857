"""A tiny random Gemma 4 decoder (Gemma4ForCausalLM) with every part Gemma 4 adds to Gemma 3.

Six layers, sliding, global, sliding, global, sliding, global: the global layers have their own
head size (32 against 16) and one key/value head against two, values read from the keys'
projection (``attention_k_eq_v``) and proportional RoPE on a quarter of their channel pairs;
the last two layers share the K/V of layers 2 and 3 and have double-wide MLPs; per-layer
embeddings (8 a layer); soft-capped logits; a sliding window of 6, shorter than the prompts.
Every weight is random, each layer's output scalar too, so a tensor read into the wrong place
cannot go unnoticed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.models.tiny import VOCAB, write_tokenizer

WINDOW = 6
LAYER_TYPES = ["sliding_attention", "full_attention"] * 3


def text_config(**overrides: Any) -> Any:
    from transformers import Gemma4TextConfig

    settings: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        sliding_window=WINDOW,
        layer_types=LAYER_TYPES,
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=8,
        final_logit_softcapping=30.0,
        max_position_embeddings=512,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "rope_theta": 100000.0,
            },
        },
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    settings.update(overrides)
    return Gemma4TextConfig(**settings)


def randomize_gemma4(model: torch.nn.Module, seed: int) -> None:
    """Every parameter and each layer's output scalar random; Gemma 4's norms scale by ``w``,
    so theirs lie around one."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1 + 0.3 * noise)
            else:
                p.copy_(noise * (2.4 / p.shape[-1] ** 0.5))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))


def save_tiny_gemma4_text(directory: Path, seed: int = 0, **overrides: Any) -> Any:
    """The randomized tiny decoder saved in ``directory`` with a tokenizer; returns the
    transformers model in float32 eval mode (eager attention)."""
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(text_config(**overrides)).float()
    randomize_gemma4(model, seed)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.save_pretrained(str(directory))
    write_tokenizer(directory)
    model.config._attn_implementation = "eager"
    return model.eval()
