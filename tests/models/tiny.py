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
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

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


def byte_level_tokenizer(
    vocab_size: int = VOCAB,
    extra_specials: list[str] | None = None,
    corpus: list[str] | None = None,
    split: str | None = None,
) -> Tokenizer:
    """A byte-level BPE trained on ``corpus`` (CORPUS by default), with the chat specials (and
    a multimodal model's own markers, ``extra_specials``) as special tokens; text is split by
    GPT-2's regex, or by ``split`` (a regex whose matches are the pieces) before the bytes."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = (
        pre_tokenizers.ByteLevel(add_prefix_space=False)
        if split is None
        else pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS + (extra_specials or []),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus or CORPUS, trainer)
    assert tok.get_vocab_size() == vocab_size
    return tok


def with_byte_fallback(trained: Tokenizer) -> Tokenizer:
    """A trained BPE with SentencePiece's byte fallback: the ``<0x00>`` ... ``<0xFF>`` tokens
    it lacks appended to its vocabulary, for the bytes of pieces it does not know."""
    spec = json.loads(trained.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    return Tokenizer.from_str(json.dumps(spec))


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


def llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's Q/K row order (convert_hf_to_gguf.py ``LlamaModel.permute``)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# llama.cpp's general.architecture for each transformers model_type (Mistral converts as Llama).
GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "phi3": "phi3",
}


def write_gguf(
    hf: Any, path: Path, *, tokenizer: Tokenizer | None = None, chat_template: str = CHATML
) -> None:
    """``hf`` as a float32 GGUF laid out as llama.cpp's convert_hf_to_gguf.py writes it: its
    tensor names, Q/K rows permuted for Llama only, Gemma norms stored as ``1 + w``, Phi-3's
    fused tensors as they are, and the metadata keys each architecture's loader reads.
    ``tokenizer`` (default: the tiny byte-level one) and ``chat_template`` go in as
    ``tokenizer.ggml.*`` keys and ``tokenizer.chat_template``."""
    import gguf

    c = hf.config
    arch = GGUF_ARCH[c.model_type]
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    elif arch == "phi3":
        partial = c.rope_parameters.get("partial_rotary_factor", 1.0)
        writer.add_rope_dimension_count(int(head_dim * partial))
        if c.sliding_window is not None:
            writer.add_sliding_window(c.sliding_window)
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "gemma2":
        writer.add_sliding_window(c.sliding_window)
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "post_attention_norm" if arch == "gemma2" else "ffn_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.qkv_proj": "attn_qkv",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.gate_up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(c.num_hidden_layers):
        for hf_name, ours in per_layer.items():
            for kind in ("weight", "bias"):
                names[f"model.layers.{i}.{hf_name}.{kind}"] = f"blk.{i}.{ours}.{kind}"
    state = hf.state_dict()
    if c.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, tensor in state.items():
        t = tensor.detach().float()
        if arch == "llama" and ".q_proj.weight" in name:
            t = llama_cpp_permute(t, c.num_attention_heads)
        elif arch == "llama" and ".k_proj.weight" in name:
            t = llama_cpp_permute(t, c.num_key_value_heads)
        elif arch == "gemma2" and name.endswith("norm.weight"):
            t = t + 1
        writer.add_tensor(names[name], t.numpy())
    _add_tokenizer(writer, tokenizer or byte_level_tokenizer(), chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_tokenizer(writer: Any, tokenizer: Tokenizer, chat_template: str) -> None:
    """A byte-level tokenizer in llama.cpp's ``tokenizer.ggml.*`` keys, its special tokens as
    control tokens."""
    spec = json.loads(tokenizer.to_str())
    specials = {t["content"] for t in spec["added_tokens"] if t["special"]}
    vocab: dict[str, int] = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(chat_template)
