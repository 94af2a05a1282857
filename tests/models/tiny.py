"""Tiny random models of each supported architecture, saved the way transformers saves them.

Shared by the parity, loader, convert and quantize tests: a small byte-level BPE tokenizer
trained on a few sentences, ChatML chat template, and ``save_pretrained`` checkpoints
(hidden 64, 2 layers) whose weights are all randomized, norms included, so that a tensor read
into the wrong place cannot go unnoticed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "A lighthouse keeper watched the storm roll in over the grey sea, counting waves.",
    "Numbers like 12345 and 3.14159 appear in text; so do tabs\tand  double spaces.",
] * 4
VOCAB = 320  # the tokenizer's size; the models' embedding has exactly this many rows

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3")
SLIDING_WINDOW = 6  # shorter than the test prompts, so the window really hides keys


def byte_level_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() == VOCAB
    return tok


def write_tokenizer(directory: Path, tok: Tokenizer | None = None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (tok or byte_level_tokenizer()).save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "add_bos_token": False,
        "chat_template": CHATML,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def hf_config(arch: str, **overrides: Any) -> Any:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    extra: dict[str, dict[str, Any]] = {
        "llama": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
        "mistral": {"sliding_window": SLIDING_WINDOW, "head_dim": 16},
        "qwen2": {"tie_word_embeddings": True},
        "qwen3": {"head_dim": 32},
        "gemma2": {
            "head_dim": 32,
            "sliding_window": SLIDING_WINDOW,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 2.0,  # small, so capping changes the scores
            "final_logit_softcapping": 5.0,
        },
        "phi3": {
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            }
        },
    }
    classes = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "gemma2": transformers.Gemma2Config,
        "phi3": transformers.Phi3Config,
    }
    return classes[arch](**(common | extra[arch] | overrides))


def randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:  # Gemma norms are offsets from one; the others scale by w
                p.copy_(0.3 * noise if "gemma" in type(model).__name__.lower() else 1 + 0.3 * noise)
            elif name.endswith("bias"):
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise * (0.6 / p.shape[-1] ** 0.5) * 4)


def save_tiny(arch: str, directory: Path, seed: int = 0, **overrides: Any) -> Any:
    """A randomized tiny ``arch`` model saved in ``directory`` (with the tokenizer); returns
    the transformers model in float32 eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        hf_config(arch, **overrides), dtype=torch.float32, attn_implementation="eager"
    )
    randomize(model, seed)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.save_pretrained(str(directory))
    write_tokenizer(directory)
    return model.eval()
