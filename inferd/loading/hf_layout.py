"""Where each of our parameters lives in a Hugging Face checkpoint, in both directions.

Our decoder fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``; most checkpoints
keep them apart (Phi-3 fuses them as we do). A plan entry lists the checkpoint tensors that are
concatenated, in order along the first dimension, into one of our parameters, with the number of
rows each contributes, so that ``convert`` can split them back.
"""

from __future__ import annotations

from dataclasses import dataclass

from inferd.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class Part:
    name: str  # the checkpoint's tensor name
    rows: int  # rows it contributes along dim 0


Plan = dict[str, tuple[Part, ...]]  # our parameter name -> its parts


def hf_plan(cfg: ModelConfig, prefix: str = "model.") -> Plan:
    """The layout of ``cfg``'s architecture; ``lm_head`` is absent when embeddings are tied."""
    h, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    kv, ff = cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    fused = cfg.architecture == "phi3"
    gemma = cfg.architecture in ("gemma2", "gemma3")

    def one(name: str, rows: int) -> tuple[Part, ...]:
        return (Part(name, rows),)

    plan: Plan = {
        "embed_tokens.weight": one(prefix + "embed_tokens.weight", cfg.vocab_size),
        "norm.weight": one(prefix + "norm.weight", h),
    }
    if not cfg.tie_word_embeddings:
        plan["lm_head.weight"] = one("lm_head.weight", cfg.vocab_size)
    for i in range(cfg.num_layers):
        src, dst = f"{prefix}layers.{i}.", f"layers.{i}."
        att, mlp = src + "self_attn.", src + "mlp."
        plan[dst + "input_norm.weight"] = one(src + "input_layernorm.weight", h)
        plan[dst + "post_attention_norm.weight"] = one(src + "post_attention_layernorm.weight", h)
        if gemma:
            plan[dst + "pre_feedforward_norm.weight"] = one(
                src + "pre_feedforward_layernorm.weight", h
            )
            plan[dst + "post_feedforward_norm.weight"] = one(
                src + "post_feedforward_layernorm.weight", h
            )
        if fused:
            plan[dst + "self_attn.qkv_proj.weight"] = one(att + "qkv_proj.weight", q + 2 * kv)
            plan[dst + "mlp.gate_up_proj.weight"] = one(mlp + "gate_up_proj.weight", 2 * ff)
        else:
            plan[dst + "self_attn.qkv_proj.weight"] = tuple(
                Part(att + f"{p}_proj.weight", n) for p, n in (("q", q), ("k", kv), ("v", kv))
            )
            plan[dst + "mlp.gate_up_proj.weight"] = (
                Part(mlp + "gate_proj.weight", ff),
                Part(mlp + "up_proj.weight", ff),
            )
        if cfg.attention_bias:
            plan[dst + "self_attn.qkv_proj.bias"] = tuple(
                Part(att + f"{p}_proj.bias", n) for p, n in (("q", q), ("k", kv), ("v", kv))
            )
        if cfg.qk_norm:
            plan[dst + "self_attn.q_norm.weight"] = one(att + "q_norm.weight", cfg.head_dim)
            plan[dst + "self_attn.k_norm.weight"] = one(att + "k_norm.weight", cfg.head_dim)
        plan[dst + "self_attn.o_proj.weight"] = one(att + "o_proj.weight", h)
        plan[dst + "mlp.down_proj.weight"] = one(mlp + "down_proj.weight", h)
    return plan


def checkpoint_prefix(names: set[str]) -> str:
    """``model.`` for transformers' CausalLM checkpoints; empty for bare base models."""
    return "" if "embed_tokens.weight" in names else "model."


# Idefics3 (SmolVLM) keeps its decoder under ``model.text_model.`` and its encoder and connector
# under ``model.``, with the names our modules use (models/vision.py, models/idefics3.py).
IDEFICS3_TEXT_PREFIX = "model.text_model."
VISION_MODULES = ("vision_model.", "connector.")


def vision_plan(params: dict[str, int]) -> Plan:
    """Our encoder's parameters (name -> rows) to their checkpoint names, one to one."""
    return {
        name: (Part("model." + name, rows),)
        for name, rows in params.items()
        if name.startswith(VISION_MODULES)
    }


# Qwen2-Audio keeps its decoder under ``language_model.model.`` (its head at
# ``language_model.lm_head``) and its encoder and projector at the top, with our modules' names
# (models/qwen2_audio.py). transformers v5 loads it as ``model.language_model.``, ``lm_head``,
# ``model.audio_tower.`` and saves the published names back.
QWEN2_AUDIO_TEXT_PREFIX = "language_model.model."
AUDIO_MODULES = ("audio_tower.", "multi_modal_projector.")


def audio_plan(params: dict[str, int], names: set[str]) -> Plan:
    """Our audio encoder's parameters (name -> rows) to their checkpoint names."""
    prefix = "" if "audio_tower.conv1.weight" in names else "model."
    return {
        name: (Part(prefix + name, rows),)
        for name, rows in params.items()
        if name.startswith(AUDIO_MODULES)
    }


def qwen2_audio_text_plan(cfg: ModelConfig, names: set[str]) -> Plan:
    """The decoder's layout in either spelling (published, or transformers v5's in memory)."""
    if QWEN2_AUDIO_TEXT_PREFIX + "embed_tokens.weight" in names:
        plan = hf_plan(cfg, QWEN2_AUDIO_TEXT_PREFIX)
        if "lm_head.weight" in plan:
            plan["lm_head.weight"] = (Part("language_model.lm_head.weight", cfg.vocab_size),)
        return plan
    return hf_plan(cfg, "model.language_model.")


# Qwen2.5-VL: the published checkpoints keep the decoder under ``model.`` and the encoder under
# ``visual.``; transformers v5 holds them as ``model.language_model.`` and ``model.visual.``.
QWEN_VL_MODULES = ("visual.",)


def qwen_vl_plan(cfg: ModelConfig, params: dict[str, int], names: set[str]) -> Plan:
    """The decoder's and the encoder's layout in either spelling."""
    v5 = "model.language_model.embed_tokens.weight" in names
    plan = hf_plan(cfg, "model.language_model." if v5 else "model.")
    prefix = "model." if any(n.startswith("model.visual.") for n in names) else ""
    plan |= {
        name: (Part(prefix + name, rows),)
        for name, rows in params.items()
        if name.startswith(QWEN_VL_MODULES)
    }
    return plan


# Gemma 3 with images: published checkpoints keep the decoder under ``language_model.model.``
# and the encoder under ``vision_tower.vision_model.``; transformers v5 saves the encoder as
# ``vision_tower.`` (no ``vision_model.``) and may spell the whole under ``model.``.
GEMMA3_VISION_MODULES = ("vision_tower.", "multi_modal_projector.")


def gemma3_vision_plan(cfg: ModelConfig, params: dict[str, int], names: set[str]) -> Plan:
    """The decoder, encoder and projector of a Gemma 3 vision checkpoint, in any spelling."""
    top = "model." if "model.multi_modal_projector.mm_input_projection_weight" in names else ""
    if "language_model.model.embed_tokens.weight" in names:
        plan = hf_plan(cfg, "language_model.model.")
        head = "language_model.lm_head.weight"
    else:
        plan = hf_plan(cfg, top + "language_model.")
        head = "lm_head.weight"
    if "lm_head.weight" in plan:
        plan["lm_head.weight"] = (Part(head, cfg.vocab_size),)
    nested = any(n.startswith(top + "vision_tower.vision_model.") for n in names)
    for name, rows in params.items():
        if name.startswith(GEMMA3_VISION_MODULES):
            source = name if nested else name.replace("vision_tower.vision_model.", "vision_tower.")
            plan[name] = (Part(top + source, rows),)
    return plan
