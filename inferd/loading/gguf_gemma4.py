"""Gemma 4's decoder (models/gemma4.py) from a GGUF in llama.cpp's layout (convert_hf_to_gguf.py's
``Gemma4Model``): its config from the ``gemma4.*`` keys and the tensors, and where each of our
parameters lives.

What the converter writes, and how it is read back:

- per-layer arrays where layers differ: ``feed_forward_length`` (the K/V-sharing layers' MLPs
  twice as wide under ``use_double_wide_mlp``), ``attention.head_count_kv`` (the global layers'
  own count) and ``attention.sliding_window_pattern`` (one bool a layer);
- the global layers' head size as ``attention.key_length``, the sliding ones' as
  ``key_length_swa``; their RoPE bases as ``rope.freq_base`` and ``rope.freq_base_swa``;
- proportional RoPE as the ``rope_freqs`` tensor, one factor per channel pair of a global head
  that divides its frequency: 1 for the pairs that rotate, 1e30 (frequency zero) for the rest;
- which layers share another's keys and values as ``attention.shared_kv_layers`` (the last ones;
  they have no ``attn_k``, ``attn_v`` or ``attn_k_norm``); a global layer whose values are its
  keys (``attention_k_eq_v``) has no ``attn_v``;
- the tensors as transformers holds them (Gemma 4's norms scale by ``w``: no ``1 + w`` shift, no
  Q/K row permutation), under llama.cpp's names: the layer scalar as ``layer_output_scale``,
  the per-layer embeddings as ``per_layer_token_embd``, ``per_layer_model_proj``,
  ``per_layer_proj_norm`` and each layer's ``inp_gate``, ``proj`` and ``post_norm``;
- the experts beside each layer's dense MLP (``enable_moe_block``) as ``expert_count``,
  ``expert_used_count`` and ``expert_feed_forward_length``, their fused gate/up and down stacks
  as transformers holds them (``ffn_gate_up_exps``, ``ffn_down_exps``: [experts, out, in]), the
  router's projection and per-channel scale as ``ffn_gate_inp``'s weight and ``.scale``, its
  per-expert scale as ``ffn_down_exps.scale``, and the three extra norms as ``pre_ffw_norm_2``,
  ``post_ffw_norm_2`` and ``post_ffw_norm_1`` (the dense MLP's output's). The stacks are read
  dequantized, each expert's matrix then filling its own projection (``loading/weights.fill``).

Gate and up experts in two stacks (``ffn_gate_exps``/``ffn_up_exps``) and a fused ``attn_qkv``
are refused.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from inferd.loading.gguf import GGUFFile
from inferd.models.config import (
    Gemma4Layers,
    ModelConfig,
    ModelConfigError,
    MoeConfig,
    gemma4_decoder_config,
    gguf_key,
)

ARCH = "gemma4"
ROPE_FREQS = "rope_freqs.weight"
# llama.cpp's factor for a channel pair that must not rotate (its frequency divided to ~0).
_FROZEN_PAIR = 1e29


def gemma4_config(gguf: GGUFFile) -> ModelConfig:
    """The decoder's config; ModelConfigError for what the file lacks or inferd cannot run."""
    meta = gguf.metadata
    shapes = {i.name: i.shape for i in gguf.tensor_infos()}
    refused = [n for n in shapes if n.endswith((".ffn_gate_exps.weight", ".attn_qkv.weight"))]
    if refused:
        raise ModelConfigError(
            f"{gguf.path}: gemma4 with {refused[0].split('.')[2]} tensors (experts' gate and up "
            "in two stacks, or fused q/k/v) is not supported yet"
        )

    key = functools.partial(gguf_key, meta, ARCH)

    layers = int(key("block_count"))
    pattern = key("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != layers:
        raise ModelConfigError(f"{ARCH}.attention.sliding_window_pattern needs {layers} bools")
    sliding = tuple(i for i, s in enumerate(pattern) if s)
    global_layers = [i for i in range(layers) if i not in sliding]
    shared = int(meta.get(f"{ARCH}.attention.shared_kv_layers") or 0)
    owners = range(layers - shared)
    kv_heads = _per_layer(key("attention.head_count_kv"), layers, "attention.head_count_kv")
    ff = _per_layer(key("feed_forward_length"), layers, "feed_forward_length")
    sliding_kv = _one_value([kv_heads[i] for i in sliding], "sliding layers' K/V heads")
    global_kv = _one_value([kv_heads[i] for i in global_layers], "global layers' K/V heads")
    width = _one_value([ff[i] for i in owners], "MLP widths")
    shared_width = _one_value([ff[i] for i in range(layers - shared, layers)], "MLP widths")
    if shared and shared_width not in (width, 2 * width):
        raise ModelConfigError(
            f"gemma4 K/V-sharing layers' MLPs are {shared_width} wide, the others {width}"
        )
    global_dim = int(key("attention.key_length"))
    per_layer = int(meta.get(f"{ARCH}.embedding_length_per_layer_input") or 0)
    layers_cfg = Gemma4Layers(
        global_head_dim=global_dim,
        global_kv_heads=global_kv,
        k_eq_v=_values_are_keys(shapes, [i for i in global_layers if i in owners]),
        kv_shared_layers=shared,
        per_layer_size=per_layer,
        per_layer_vocab=shapes["per_layer_token_embd.weight"][0] if per_layer else 0,
        double_wide_mlp=shared > 0 and shared_width == 2 * width,
        global_rotary_fraction=_rotary_fraction(gguf, global_dim) if global_layers else 1.0,
        pad_token_id=int(meta.get("tokenizer.ggml.padding_token_id") or 0),
    )
    window = meta.get(f"{ARCH}.attention.sliding_window")
    softcap = meta.get(f"{ARCH}.final_logit_softcapping")
    cfg = gemma4_decoder_config(
        vocab_size=shapes["token_embd.weight"][0],
        hidden_size=int(key("embedding_length")),
        intermediate_size=width,
        num_layers=layers,
        num_heads=int(key("attention.head_count")),
        num_kv_heads=sliding_kv if sliding else global_kv,
        head_dim=int(meta.get(f"{ARCH}.attention.key_length_swa") or global_dim),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base")),
        rope_local_theta=float(meta.get(f"{ARCH}.rope.freq_base_swa") or key("rope.freq_base")),
        max_position=int(key("context_length")),
        tie_word_embeddings="output.weight" not in shapes,
        sliding_window=int(window) if sliding and window is not None else None,
        sliding_layers=sliding,
        final_softcap=None if softcap is None else float(softcap),
        layers=layers_cfg,
    )
    if "blk.0.ffn_gate_inp.weight" not in shapes:
        return cfg
    moe = MoeConfig(
        num_experts=int(key("expert_count")),
        top_k=int(key("expert_used_count")),
        intermediate_size=int(key("expert_feed_forward_length")),
        layers=tuple(range(layers)),
    )
    return replace(cfg, moe=moe)


def _per_layer(value: Any, layers: int, name: str) -> list[int]:
    """A key llama.cpp writes once, or once per layer where layers differ."""
    values = value if isinstance(value, list) else [value] * layers
    if len(values) != layers:
        raise ModelConfigError(f"{ARCH}.{name} has {len(values)} entries for {layers} layers")
    return [int(v) for v in values]


def _one_value(values: list[int], what: str) -> int:
    if len(set(values)) > 1:
        raise ModelConfigError(f"gemma4 {what} differ: {sorted(set(values))}")
    return values[0] if values else 0


def _values_are_keys(shapes: Mapping[str, tuple[int, ...]], global_owners: list[int]) -> bool:
    """``attention_k_eq_v``: the global layers that own K/V have no ``attn_v`` (all or none)."""
    missing = [i for i in global_owners if f"blk.{i}.attn_v.weight" not in shapes]
    if missing and len(missing) != len(global_owners):
        raise ModelConfigError(f"gemma4 global layers {missing} alone lack attn_v")
    return bool(missing)


def _rotary_fraction(gguf: GGUFFile, head_dim: int) -> float:
    """The share of a global head's channel pairs that rotate, from ``rope_freqs``: llama.cpp's
    factors are 1 for those (the first ones) and huge for the rest; any other factor is
    refused (it would scale the frequencies, which proportional RoPE does not)."""
    if ROPE_FREQS not in {i.name for i in gguf.tensor_infos()}:
        return 1.0  # plain RoPE on every pair
    factors = gguf.load_tensor(ROPE_FREQS).tolist()
    rotating = sum(1 for f in factors if f == 1.0)
    if len(factors) != head_dim // 2 or any(f < _FROZEN_PAIR for f in factors[rotating:]):
        raise ModelConfigError(
            f"gemma4 rope_freqs of {len(factors)} factors is not proportional RoPE over "
            f"{head_dim // 2} channel pairs (ones, then frozen pairs)"
        )
    return 2 * rotating / head_dim


def gemma4_weight_plan(cfg: ModelConfig) -> dict[str, list[str]]:
    """Our parameters from llama.cpp's tensors, each stored as transformers holds it (joined
    in order where ours is fused; per layer at its own shape: a sharing layer has only
    ``attn_q``, a ``k_eq_v`` global layer no ``attn_v``)."""
    g = cfg.gemma4
    assert g is not None
    plan = {
        "embed_tokens.weight": ["token_embd.weight"],
        "norm.weight": ["output_norm.weight"],
    }
    if not cfg.tie_word_embeddings:
        plan["lm_head.weight"] = ["output.weight"]
    one_to_one = {
        "input_norm.weight": "attn_norm.weight",
        "post_attention_norm.weight": "post_attention_norm.weight",
        "pre_feedforward_norm.weight": "ffn_norm.weight",
        "post_feedforward_norm.weight": "post_ffw_norm.weight",
        "layer_scalar": "layer_output_scale.weight",
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    if g.per_layer_size:
        plan["embed_tokens_per_layer.weight"] = ["per_layer_token_embd.weight"]
        plan["per_layer_model_projection.weight"] = ["per_layer_model_proj.weight"]
        plan["per_layer_projection_norm.weight"] = ["per_layer_proj_norm.weight"]
        one_to_one |= {
            "per_layer_input_gate.weight": "inp_gate.weight",
            "per_layer_projection.weight": "proj.weight",
            "post_per_layer_input_norm.weight": "post_norm.weight",
        }
    for i in range(cfg.num_layers):
        b, m = f"blk.{i}.", f"layers.{i}."
        for ours, theirs in one_to_one.items():
            plan[m + ours] = [b + theirs]
        qkv = [b + "attn_q.weight"]
        if cfg.kv_source(i) == i:
            qkv.append(b + "attn_k.weight")
            if not (g.k_eq_v and cfg.window_of(i) is None):
                qkv.append(b + "attn_v.weight")
            plan[m + "self_attn.k_norm.weight"] = [b + "attn_k_norm.weight"]
        plan[m + "self_attn.qkv_proj.weight"] = qkv
        plan[m + "mlp.gate_up_proj.weight"] = [b + "ffn_gate.weight", b + "ffn_up.weight"]
        if cfg.moe is not None:
            plan |= {m + "moe." + ours: [b + theirs] for ours, theirs in _MOE_TENSORS.items()}
    return plan


# A layer's experts, router and their norms (models/gemma4.py ``Gemma4MoE``): llama.cpp's names.
_MOE_TENSORS = {
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight",
    "router.proj.weight": "ffn_gate_inp.weight",
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "pre_norm.weight": "pre_ffw_norm_2.weight",
    "post_norm.weight": "post_ffw_norm_2.weight",
    "mlp_post_norm.weight": "post_ffw_norm_1.weight",
}
