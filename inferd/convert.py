"""``inferd convert MODEL OUTDIR``: write a GGUF model out as a Hugging Face directory.

The directory is what transformers' ``save_pretrained`` would write for the architecture:
``config.json``, ``model.safetensors`` (HF tensor names and layout: q/k/v and gate/up split
again, llama.cpp's Q/K row order undone), ``tokenizer.json``, ``tokenizer_config.json`` (with
the chat template), ``generation_config.json`` (EOS and end-of-turn stops). Weights are written
dequantized, in float32 by default, so loading the directory gives the same logits as the GGUF.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from inferd.loading.chat_template import ChatTemplate
from inferd.loading.gguf import GGUFFile
from inferd.loading.gguf_model import load_gguf_model
from inferd.loading.hf_layout import hf_plan
from inferd.loading.tokenizer import TokenizerBundle, tokenizer_from_gguf
from inferd.models.config import HF_ARCHITECTURES, ModelConfig, ModelConfigError
from inferd.models.llama import LlamaForCausalLM

SAVE_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class ConvertError(ValueError):
    """A model that cannot be written out; the message says why."""


def hf_config_dict(
    cfg: ModelConfig,
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """The transformers ``config.json`` for ``cfg`` (v5 ``rope_parameters``, plus the v4
    ``rope_theta``/``rope_scaling`` keys that older readers look for)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    scaling = cfg.rope_scaling
    if scaling.kind == "linear":
        rope |= {"rope_type": "linear", "factor": scaling.factor}
    elif scaling.kind == "llama3":
        rope |= {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position,
        }
    if cfg.rotary_dim is not None:
        rope["partial_rotary_factor"] = cfg.rotary_dim / cfg.head_dim
    act = "gelu_pytorch_tanh" if cfg.hidden_act == "gelu_tanh" else "silu"
    out: dict[str, Any] = {
        "architectures": [HF_ARCHITECTURES[cfg.architecture]],
        "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position,
        "rope_parameters": rope,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "dtype": _DTYPE_NAMES[dtype],
    }
    if rope["rope_type"] != "default":
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if cfg.architecture in ("llama", "qwen3"):
        out |= {"attention_bias": False, "mlp_bias": False}
    if cfg.architecture in ("qwen2", "qwen3"):
        out["use_sliding_window"] = cfg.sliding_window is not None
    if cfg.sliding_window is not None or cfg.architecture in ("mistral", "phi3", "gemma2"):
        out["sliding_window"] = cfg.sliding_window
    if cfg.sliding_window is not None or cfg.architecture == "gemma2":
        out["layer_types"] = [
            "sliding_attention" if i in cfg.sliding_layers else "full_attention"
            for i in range(cfg.num_layers)
        ]
    if cfg.architecture == "gemma2":
        scalar = (cfg.attention_scale or cfg.head_dim**-0.5) ** -2
        out |= {
            "hidden_activation": act,
            # transformers wants an int here, which every Gemma 2 checkpoint has
            "query_pre_attn_scalar": round(scalar)
            if abs(scalar - round(scalar)) < 1e-3
            else scalar,
            "attn_logit_softcapping": cfg.attn_softcap,
            "final_logit_softcapping": cfg.final_softcap,
        }
    return out


def hf_state_dict(model: LlamaForCausalLM, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's weights under transformers' names (fused tensors split again)."""
    tensors: dict[str, torch.Tensor] = {}
    params = dict(model.named_parameters())
    for target, parts in hf_plan(model.config).items():
        if target not in params:
            raise ConvertError(f"the model has no parameter {target}")
        value = params[target].detach()
        if value.numel() == 0:
            raise ConvertError(f"{target} is quantized in place (--isq); convert needs weights")
        rows = [p.rows for p in parts]
        for part, chunk in zip(parts, value.split(rows), strict=True):
            tensors[part.name] = chunk.to(dtype).contiguous()
    return tensors


def tokenizer_config(
    tokenizer: TokenizerBundle, template: ChatTemplate, max_position: int
) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "add_bos_token": tokenizer.add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_position,
        "chat_template": template.source,
    }


def stop_ids(tokenizer: TokenizerBundle, template: ChatTemplate) -> list[int]:
    """EOS, then the template's end-of-turn tokens (what the engine stops on)."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for marker in template.end_of_turn_tokens():
        token_id = tokenizer.tokenizer.token_to_id(marker)
        if token_id is not None and token_id not in ids:
            ids.append(token_id)
    return ids


def convert_gguf(path: Path, out: Path, *, dtype: str = "f32", progress: bool = True) -> Path:
    """Write the GGUF model at ``path`` as a HF directory ``out`` (created; must be empty)."""
    from safetensors.torch import save_file

    if dtype not in SAVE_DTYPES:
        raise ConvertError(f"unknown dtype {dtype!r}; choose {', '.join(SAVE_DTYPES)}")
    torch_dtype = SAVE_DTYPES[dtype]
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConvertError(f"{out} exists and is not an empty directory")
    gguf = GGUFFile(path)
    if "rope_freqs.weight" in {i.name for i in gguf.tensor_infos()}:
        raise ConvertError(
            f"{path} carries precomputed rope_freqs factors, which config.json cannot express"
        )
    try:
        model, cfg = load_gguf_model(gguf, torch.float32, progress=progress, packed_kernels=False)
    except ModelConfigError as exc:
        raise ConvertError(str(exc)) from None
    if cfg.moe is not None:  # config.json would describe a dense model and drop the experts
        raise ConvertError(f"{path}: a mixture-of-experts model cannot be converted yet")
    tokenizer = tokenizer_from_gguf(gguf.metadata)
    template = ChatTemplate.from_metadata(
        gguf.metadata, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token
    )
    out.mkdir(parents=True, exist_ok=True)
    stops = stop_ids(tokenizer, template)
    metadata = {"format": "pt", "converted_by": "inferd", "source": path.name}
    save_file(hf_state_dict(model, torch_dtype), str(out / "model.safetensors"), metadata)
    config = hf_config_dict(
        cfg,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=_pad_id(gguf.metadata, cfg.vocab_size),
        dtype=torch_dtype,
    )
    _write_json(out / "config.json", config)
    tokenizer.tokenizer.save(str(out / "tokenizer.json"))
    _write_json(
        out / "tokenizer_config.json", tokenizer_config(tokenizer, template, cfg.max_position)
    )
    generation: dict[str, Any] = {"bos_token_id": tokenizer.bos_token_id}
    generation["eos_token_id"] = stops[0] if len(stops) == 1 else stops or None
    _write_json(out / "generation_config.json", generation)
    return out


def _pad_id(metadata: Mapping[str, Any], vocab_size: int) -> int | None:
    value = metadata.get("tokenizer.ggml.padding_token_id")
    return int(value) if value is not None and 0 <= int(value) < vocab_size else None


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
