"""The config.json of real models (as published on the Hugging Face Hub), for decisions that are
arithmetic on a model's shape: no weights needed."""

from __future__ import annotations

from typing import Any

LLAMA_3_8B: dict[str, Any] = {  # meta-llama/Meta-Llama-3-8B
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}

LLAMA_3_1_8B: dict[str, Any] = {  # meta-llama/Llama-3.1-8B: llama3 rope scaling
    **LLAMA_3_8B,
    "max_position_embeddings": 131072,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}

MISTRAL_7B: dict[str, Any] = {  # mistralai/Mistral-7B-v0.1
    "architectures": ["MistralForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 32000,
}

QWEN2_5_7B: dict[str, Any] = {  # Qwen/Qwen2.5-7B-Instruct
    "architectures": ["Qwen2ForCausalLM"],
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 152064,
}

GEMMA_2_9B: dict[str, Any] = {  # google/gemma-2-9b
    "architectures": ["Gemma2ForCausalLM"],
    "attention_bias": False,
    "attn_logit_softcapping": 50.0,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": 1,
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 3584,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "gemma2",
    "num_attention_heads": 16,
    "num_hidden_layers": 42,
    "num_key_value_heads": 8,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "torch_dtype": "float32",
    "vocab_size": 256000,
}

FOUR = {
    "Llama-3-8B": LLAMA_3_8B,
    "Mistral-7B-v0.1": MISTRAL_7B,
    "Qwen2.5-7B-Instruct": QWEN2_5_7B,
    "Gemma-2-9B": GEMMA_2_9B,
}


def dense_weight_bytes(hf: dict[str, Any], dtype_bytes: int = 2) -> int:
    """Bytes of a model's dense weights (embedding, blocks, norms, output head; biases aside)."""
    hidden, inter, layers = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf.get("head_dim") or hidden // heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    norms = (4 if hf["model_type"] == "gemma2" else 2) * hidden
    embed = hf["vocab_size"] * hidden
    head = 0 if hf.get("tie_word_embeddings", hf["model_type"] == "gemma2") else embed
    params = embed + head + layers * (attention + 3 * hidden * inter + norms) + hidden
    return params * dtype_bytes
