"""``inferd convert MODEL OUTDIR``: write a GGUF model out as a Hugging Face directory.

The directory is what transformers' ``save_pretrained`` would write for the architecture:
``config.json``, ``model.safetensors`` (HF tensor names and layout: q/k/v and gate/up split
again, llama.cpp's Q/K row order undone), ``tokenizer.json``, ``tokenizer_config.json`` (with
the chat template), ``generation_config.json`` (EOS and end-of-turn stops). Weights are written
dequantized, in float32 by default, so loading the directory gives the same logits as the GGUF.

A Gemma 4 or Gemma 3n GGUF (a language model) becomes transformers' text model,
``Gemma4ForCausalLM`` or ``Gemma3nForCausalLM``: its ``gemma4_text`` / ``gemma3n_text`` config
(Gemma 4's proportional RoPE as ``partial_rotary_factor``, its experts; Gemma 3n's per-layer MLP
widths and sparsity), checked to read back as the GGUF's config, and the tensors under the
names those classes load (loading/hf_layout.py's ``gemma4_plan`` / ``gemma3n_plan``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from inferd.loading.chat_template import ChatTemplate
from inferd.loading.gguf import GGUFFile
from inferd.loading.gguf_model import gguf_config, load_gguf_model
from inferd.loading.hf_layout import Plan, gemma3n_plan, gemma4_plan, hf_plan
from inferd.loading.tokenizer import TokenizerBundle, tokenizer_from_gguf
from inferd.loading.weights import expert_projections
from inferd.models.config import HF_ARCHITECTURES, ModelConfig, ModelConfigError, config_from_hf
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
    tokens = {
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "dtype": _DTYPE_NAMES[dtype],
    }
    if cfg.gemma4 is not None:  # Gemma 4, or Gemma 3n built on its parts
        gemma = _gemma3n_text_config(cfg) if cfg.gemma3n is not None else _gemma4_text_config(cfg)
        return _read_back(gemma | tokens, cfg)
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
        **tokens,
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


def _gemma_text_config(cfg: ModelConfig, model_type: str, architecture: str) -> dict[str, Any]:
    """What Gemma 4's and Gemma 3n's text configs share."""
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta}
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position,
        "sliding_window": cfg.sliding_window,
        "layer_types": [
            "sliding_attention" if i in cfg.sliding_layers else "full_attention"
            for i in range(cfg.num_layers)
        ],
        "final_logit_softcapping": cfg.final_softcap,
        "rope_parameters": {"sliding_attention": local},
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
    }


def _gemma4_text_config(cfg: ModelConfig) -> dict[str, Any]:
    """``Gemma4ForCausalLM``'s config: the global layers' own shape, proportional RoPE on the
    share of their channels that rotate, K/V sharing, per-layer embeddings, experts."""
    g = cfg.gemma4
    assert g is not None
    out = _gemma_text_config(cfg, "gemma4_text", "Gemma4ForCausalLM")
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if g.global_rotary_fraction != 1.0:
        full |= {"rope_type": "proportional", "partial_rotary_factor": g.global_rotary_fraction}
    out["rope_parameters"]["full_attention"] = full
    out |= {
        "intermediate_size": cfg.intermediate_size,
        "global_head_dim": g.global_head_dim,
        "num_global_key_value_heads": g.global_kv_heads,
        "attention_k_eq_v": g.k_eq_v,
        "num_kv_shared_layers": g.kv_shared_layers,
        "use_double_wide_mlp": g.double_wide_mlp,
        "hidden_size_per_layer_input": g.per_layer_size,
        "vocab_size_per_layer_input": g.per_layer_vocab,
        "enable_moe_block": cfg.moe is not None,
    }
    if cfg.moe is not None:
        out |= {
            "num_experts": cfg.moe.num_experts,
            "top_k_experts": cfg.moe.top_k,
            "moe_intermediate_size": cfg.moe.intermediate_size,
        }
    return out


def _gemma3n_text_config(cfg: ModelConfig) -> dict[str, Any]:
    """``Gemma3nForCausalLM``'s config: AltUp, Laurel, each layer's MLP width and sparsity,
    K/V sharing and the per-layer embeddings."""
    g, shared = cfg.gemma3n, cfg.gemma4
    assert g is not None and shared is not None
    out = _gemma_text_config(cfg, "gemma3n_text", "Gemma3nForCausalLM")
    out["rope_parameters"]["full_attention"] = {
        "rope_type": "default",
        "rope_theta": cfg.rope_theta,
    }
    return out | {
        "intermediate_size": list(g.intermediate_sizes),
        "activation_sparsity_pattern": list(g.sparsity),
        "altup_num_inputs": g.altup_inputs,
        "altup_active_idx": g.altup_active,
        "altup_correct_scale": g.altup_correct_scale,
        "laurel_rank": g.laurel_rank,
        "num_kv_shared_layers": shared.kv_shared_layers,
        "hidden_size_per_layer_input": shared.per_layer_size,
        "vocab_size_per_layer_input": shared.per_layer_vocab,
    }


def _layout(cfg: ModelConfig) -> Plan:
    """Where each of our parameters goes in the architecture's transformers checkpoint."""
    if cfg.gemma3n is not None:
        return gemma3n_plan(cfg, set())
    if cfg.gemma4 is not None:
        return gemma4_plan(cfg, set())
    return hf_plan(cfg)


def hf_state_dict(model: LlamaForCausalLM, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's weights under transformers' names (fused tensors split again)."""
    tensors: dict[str, torch.Tensor] = {}
    params = dict(model.named_parameters())
    for target, parts in _layout(model.config).items():
        value = _our_tensor(model, params, target)
        if value.numel() == 0:
            raise ConvertError(f"{target} is quantized in place (--isq); convert needs weights")
        rows = [p.rows for p in parts]
        for part, chunk in zip(parts, value.split(rows), strict=True):
            tensors[part.name] = chunk.to(dtype).contiguous()
    return tensors


def _our_tensor(
    model: LlamaForCausalLM, params: dict[str, torch.nn.Parameter], target: str
) -> torch.Tensor:
    """Our parameter ``target``; for an expert stack (``...experts.gate_up_proj``), each
    expert's projection's weight (layers/moe.py) stacked back as transformers holds them."""
    if target in params:
        return params[target].detach()
    try:
        experts = expert_projections(model, target)
    except AttributeError:  # no module of that name
        experts = None
    if experts is None:
        raise ConvertError(f"the model has no parameter {target}")
    return torch.stack([p.layer.weight.detach() for p in experts])


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
    try:
        cfg = gguf_config(gguf)
        if cfg.gemma4 is None and cfg.architecture not in HF_ARCHITECTURES:
            raise ConvertError(
                f"convert does not write {cfg.architecture} models yet (it writes "
                f"{', '.join([*HF_ARCHITECTURES, 'gemma4', 'gemma3n'])}); serve the GGUF as it is"
            )
        # Gemma 4's rope_freqs mark its proportional RoPE, which its config says
        if cfg.gemma4 is None and "rope_freqs.weight" in {i.name for i in gguf.tensor_infos()}:
            raise ConvertError(
                f"{path} carries precomputed rope_freqs factors, which config.json cannot express"
            )
        # only gemma4_text says experts; another config.json would describe a dense model
        if cfg.moe is not None and cfg.gemma4 is None:
            raise ConvertError(f"{path}: a mixture-of-experts model cannot be converted yet")
        model, cfg = load_gguf_model(gguf, torch.float32, progress=progress, packed_kernels=False)
    except ModelConfigError as exc:
        raise ConvertError(str(exc)) from None
    tokenizer = tokenizer_from_gguf(gguf.metadata)
    template = ChatTemplate.from_metadata(
        gguf.metadata, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token
    )
    config = hf_config_dict(
        cfg,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=_pad_id(gguf.metadata, cfg.vocab_size),
        dtype=torch_dtype,
    )
    out.mkdir(parents=True, exist_ok=True)
    stops = stop_ids(tokenizer, template)
    metadata = {"format": "pt", "converted_by": "inferd", "source": path.name}
    save_file(hf_state_dict(model, torch_dtype), str(out / "model.safetensors"), metadata)
    _write_json(out / "config.json", config)
    tokenizer.tokenizer.save(str(out / "tokenizer.json"))
    _write_json(
        out / "tokenizer_config.json", tokenizer_config(tokenizer, template, cfg.max_position)
    )
    generation: dict[str, Any] = {"bos_token_id": tokenizer.bos_token_id}
    generation["eos_token_id"] = stops[0] if len(stops) == 1 else stops or None
    _write_json(out / "generation_config.json", generation)
    return out


def _read_back(config: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """``config``, once it reads back as ``cfg``; ConvertError otherwise: a Gemma GGUF may hold
    a shape transformers' config cannot say (e.g. global layers with a K/V head count of their
    own whose values are not their keys)."""
    again = config_from_hf(config, has_lm_head=not cfg.tie_word_embeddings)
    if again != cfg:
        differ = [f for f in ("gemma4", "gemma3n", "moe") if getattr(again, f) != getattr(cfg, f)]
        raise ConvertError(
            f"transformers' {config['model_type']} config cannot express this model (its "
            f"{', '.join(differ) or 'shape'} would read back differently)"
        )
    return config


def _pad_id(metadata: Mapping[str, Any], vocab_size: int) -> int | None:
    value = metadata.get("tokenizer.ggml.padding_token_id")
    return int(value) if value is not None and 0 <= int(value) < vocab_size else None


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
