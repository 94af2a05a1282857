"""Where each of our parameters lives in a Hugging Face checkpoint, in both directions.

Our decoder fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``; most checkpoints
keep them apart (Phi-3 fuses them as we do). A plan entry lists the checkpoint tensors that are
concatenated, in order along the first dimension, into one of our parameters, with the number of
rows each contributes, so that ``convert`` can split them back.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from inferd.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class Cut:
    """The part of a checkpoint tensor that a MatFormer slice keeps (loading/matformer.py):
    its first ``rows`` rows and ``cols`` columns (None: all), and of its ``blocks`` equal
    blocks along ``block_dim`` only those numbered in ``keep`` (the per-layer embeddings of
    the layers kept)."""

    rows: int | None = None
    cols: int | None = None
    blocks: int = 1
    keep: tuple[int, ...] = ()
    block_dim: int = 0

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        t = t[: self.rows, : self.cols] if t.dim() == 2 else t[: self.rows]
        if self.keep:
            shape = t.shape
            per = shape[self.block_dim] // self.blocks
            pieces = t.unflatten(self.block_dim, (self.blocks, per))
            t = pieces.index_select(self.block_dim, torch.tensor(self.keep)).flatten(
                self.block_dim, self.block_dim + 1
            )
        return t.contiguous()


@dataclass(frozen=True, slots=True)
class Part:
    name: str  # the checkpoint's tensor name
    rows: int  # rows it contributes along dim 0
    cut: Cut | None = None  # None: the whole tensor
    # Experts stacked [experts, out, in] (``Experts``' layout): each expert's (out, in). A
    # stack saved with each matrix transposed, as transformers 4 saved Qwen3-VL-MoE's
    # (published checkpoints), is transposed back, as transformers 5 does (not when square).
    experts: tuple[int, int] | None = None

    def take(self, t: torch.Tensor) -> torch.Tensor:
        if self.experts is not None and tuple(t.shape[1:]) == self.experts[::-1] != self.experts:
            t = t.transpose(1, 2).contiguous()
        return t if self.cut is None else self.cut.apply(t)


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
        else:
            plan[dst + "self_attn.qkv_proj.weight"] = tuple(
                Part(att + f"{p}_proj.weight", n) for p, n in (("q", q), ("k", kv), ("v", kv))
            )
        if cfg.attention_bias:
            plan[dst + "self_attn.qkv_proj.bias"] = tuple(
                Part(att + f"{p}_proj.bias", n) for p, n in (("q", q), ("k", kv), ("v", kv))
            )
        if cfg.qk_norm:
            plan[dst + "self_attn.q_norm.weight"] = one(att + "q_norm.weight", cfg.head_dim)
            plan[dst + "self_attn.k_norm.weight"] = one(att + "k_norm.weight", cfg.head_dim)
        plan[dst + "self_attn.o_proj.weight"] = one(att + "o_proj.weight", h)
        if cfg.moe is not None and i in cfg.moe.layers:
            plan |= experts_plan(cfg, mlp, dst + "mlp.")
            plan[dst + "mlp.gate.weight"] = one(mlp + "gate.weight", cfg.moe.num_experts)
            continue
        if fused:
            plan[dst + "mlp.gate_up_proj.weight"] = one(mlp + "gate_up_proj.weight", 2 * ff)
        else:
            plan[dst + "mlp.gate_up_proj.weight"] = (
                Part(mlp + "gate_proj.weight", ff),
                Part(mlp + "up_proj.weight", ff),
            )
        plan[dst + "mlp.down_proj.weight"] = one(mlp + "down_proj.weight", h)
    return plan


def experts_plan(cfg: ModelConfig, src: str, dst: str) -> Plan:
    """A layer's experts (layers/moe.py ``Experts``) from the checkpoint's fused stacks under
    ``src``, to ours under ``dst``."""
    moe = cfg.moe
    assert moe is not None
    h, ff = cfg.hidden_size, moe.intermediate_size
    return {
        f"{dst}experts.{name}": (Part(f"{src}experts.{name}", moe.num_experts, experts=shape),)
        for name, shape in (("gate_up_proj", (2 * ff, h)), ("down_proj", (h, ff)))
    }


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


def gemma4_plan(cfg: ModelConfig, names: set[str]) -> Plan:
    """Gemma 4's decoder (models/gemma4.py) under ``model.`` (Gemma4ForCausalLM) or
    ``model.language_model.`` (Gemma4ForConditionalGeneration): each layer's projections at
    its own shape; a K/V-sharing layer has no k/v projections or k norm, and a ``k_eq_v``
    global layer no v projection."""
    g = cfg.gemma4
    assert g is not None
    nested = "model.language_model.embed_tokens.weight" in names
    prefix = "model.language_model." if nested else "model."
    h, ff = cfg.hidden_size, cfg.intermediate_size

    def one(name: str, rows: int) -> tuple[Part, ...]:
        return (Part(prefix + name, rows),)

    plan: Plan = {
        "embed_tokens.weight": one("embed_tokens.weight", cfg.vocab_size),
        "norm.weight": one("norm.weight", h),
    }
    if not cfg.tie_word_embeddings:
        plan["lm_head.weight"] = (Part("lm_head.weight", cfg.vocab_size),)
    if g.per_layer_size:
        width = cfg.num_layers * g.per_layer_size
        plan["embed_tokens_per_layer.weight"] = one(
            "embed_tokens_per_layer.weight", g.per_layer_vocab
        )
        plan["per_layer_model_projection.weight"] = one("per_layer_model_projection.weight", width)
        plan["per_layer_projection_norm.weight"] = one(
            "per_layer_projection_norm.weight", g.per_layer_size
        )
    for i in range(cfg.num_layers):
        src, dst = f"layers.{i}.", f"layers.{i}."
        kv_heads, head_dim = cfg.kv_shape(i)
        q, kv = cfg.num_heads * head_dim, kv_heads * head_dim
        owns_kv = cfg.kv_source(i) == i
        wide = 2 if g.double_wide_mlp and not owns_kv else 1
        norms = {
            "input_norm": "input_layernorm",
            "post_attention_norm": "post_attention_layernorm",
            "pre_feedforward_norm": "pre_feedforward_layernorm",
            "post_feedforward_norm": "post_feedforward_layernorm",
        }
        for ours, theirs in norms.items():
            plan[f"{dst}{ours}.weight"] = one(f"{src}{theirs}.weight", h)
        plan[dst + "layer_scalar"] = one(src + "layer_scalar", 1)
        att = src + "self_attn."
        parts = [Part(prefix + att + "q_proj.weight", q)]
        if owns_kv:
            parts.append(Part(prefix + att + "k_proj.weight", kv))
            if not (g.k_eq_v and cfg.window_of(i) is None):
                parts.append(Part(prefix + att + "v_proj.weight", kv))
            plan[dst + "self_attn.k_norm.weight"] = one(att + "k_norm.weight", head_dim)
        plan[dst + "self_attn.qkv_proj.weight"] = tuple(parts)
        plan[dst + "self_attn.q_norm.weight"] = one(att + "q_norm.weight", head_dim)
        plan[dst + "self_attn.o_proj.weight"] = one(att + "o_proj.weight", h)
        plan[dst + "mlp.gate_up_proj.weight"] = (
            Part(prefix + src + "mlp.gate_proj.weight", ff * wide),
            Part(prefix + src + "mlp.up_proj.weight", ff * wide),
        )
        plan[dst + "mlp.down_proj.weight"] = one(src + "mlp.down_proj.weight", h)
        if cfg.moe is not None:
            plan |= gemma4_moe_plan(cfg, prefix + src, dst + "moe.")
        if g.per_layer_size:
            for name, rows in (
                ("per_layer_input_gate", g.per_layer_size),
                ("per_layer_projection", h),
                ("post_per_layer_input_norm", h),
            ):
                plan[f"{dst}{name}.weight"] = one(f"{src}{name}.weight", rows)
    return plan


def gemma4_moe_plan(cfg: ModelConfig, src: str, dst: str) -> Plan:
    """A Gemma 4 layer's experts, router and their norms (models/gemma4.py ``Gemma4MoE``)."""
    moe = cfg.moe
    assert moe is not None
    h, e = cfg.hidden_size, moe.num_experts
    plan = experts_plan(cfg, src, dst)
    for ours, theirs, rows in (
        ("router.proj.weight", "router.proj.weight", e),
        ("router.scale", "router.scale", h),
        ("router.per_expert_scale", "router.per_expert_scale", e),
        ("pre_norm.weight", "pre_feedforward_layernorm_2.weight", h),
        ("post_norm.weight", "post_feedforward_layernorm_2.weight", h),
        ("mlp_post_norm.weight", "post_feedforward_layernorm_1.weight", h),
    ):
        plan[dst + ours] = (Part(src + theirs, rows),)
    return plan


def gemma3n_plan(cfg: ModelConfig, names: set[str]) -> Plan:
    """Gemma 3n's decoder (models/gemma3n.py) under ``model.`` (Gemma3nForCausalLM) or
    ``model.language_model.`` (Gemma3nForConditionalGeneration, whose media tables and audio
    encoder ``gemma_media_plan`` reads; its image encoder stays unread).
    Each of our layers reads its checkpoint layer (``Gemma3nLayers.source_layers``); under a
    MatFormer slice the MLPs keep their first ``intermediate_sizes[i]`` units and the PLE
    tables the blocks of the layers kept. K/V-sharing layers have no k/v projections."""
    g, shared = cfg.gemma3n, cfg.gemma4
    assert g is not None and shared is not None
    nested = "model.language_model.embed_tokens.weight" in names
    prefix = "model.language_model." if nested else "model."
    h, per, k = cfg.hidden_size, shared.per_layer_size, g.altup_inputs
    sliced = g.source_layers != tuple(range(g.source_num_layers))
    rows_cut = Cut(blocks=g.source_num_layers, keep=g.source_layers) if sliced else None
    cols_cut = replace(rows_cut, block_dim=1) if rows_cut is not None else None

    def one(name: str, rows: int, cut: Cut | None = None) -> tuple[Part, ...]:
        return (Part(prefix + name, rows, cut),)

    width = cfg.num_layers * per
    plan: Plan = {
        "embed_tokens.weight": one("embed_tokens.weight", cfg.vocab_size),
        "norm.weight": one("norm.weight", h),
        "embed_tokens_per_layer.weight": one(
            "embed_tokens_per_layer.weight",
            shared.per_layer_vocab,
            cols_cut,
        ),
        "per_layer_model_projection.weight": one(
            "per_layer_model_projection.weight", width, rows_cut
        ),
        "per_layer_projection_norm.weight": one("per_layer_projection_norm.weight", per),
    }
    if not cfg.tie_word_embeddings:
        plan["lm_head.weight"] = (Part("lm_head.weight", cfg.vocab_size),)
    for i in range(1, k):
        for table in ("altup_projections", "altup_unembed_projections"):
            plan[f"{table}.{i - 1}.weight"] = one(f"{table}.{i - 1}.weight", h)
    for i, source in enumerate(g.source_layers):
        src, dst = f"layers.{source}.", f"layers.{i}."
        q = cfg.num_heads * cfg.head_dim
        kv = cfg.num_kv_heads * cfg.head_dim
        ff = g.intermediate_sizes[i]
        sizes = {
            "input_norm": ("input_layernorm", h),
            "post_attention_norm": ("post_attention_layernorm", h),
            "pre_feedforward_norm": ("pre_feedforward_layernorm", h),
            "post_feedforward_norm": ("post_feedforward_layernorm", h),
            "self_attn.q_norm": ("self_attn.q_norm", cfg.head_dim),
            "self_attn.o_proj": ("self_attn.o_proj", h),
            "altup.correction_coefs": ("altup.correction_coefs", k),
            "altup.prediction_coefs": ("altup.prediction_coefs", k * k),
            "altup.modality_router": ("altup.modality_router", k),
            "altup.router_norm": ("altup.router_norm", h),
            "laurel.linear_left": ("laurel.linear_left", g.laurel_rank),
            "laurel.linear_right": ("laurel.linear_right", h),
            "laurel.post_laurel_norm": ("laurel.post_laurel_norm", h),
            "per_layer_input_gate": ("per_layer_input_gate", per),
            "per_layer_projection": ("per_layer_projection", h),
            "post_per_layer_input_norm": ("post_per_layer_input_norm", h),
        }
        for ours, (theirs, rows) in sizes.items():
            plan[f"{dst}{ours}.weight"] = one(f"{src}{theirs}.weight", rows)
        plan[dst + "altup.correct_output_scale"] = one(src + "altup.correct_output_scale", h)
        att = prefix + src + "self_attn."
        parts = [Part(att + "q_proj.weight", q)]
        if cfg.kv_source(i) == i:
            parts += [Part(att + "k_proj.weight", kv), Part(att + "v_proj.weight", kv)]
            plan[dst + "self_attn.k_norm.weight"] = one(
                src + "self_attn.k_norm.weight", cfg.head_dim
            )
        plan[dst + "self_attn.qkv_proj.weight"] = tuple(parts)
        mlp = prefix + src + "mlp."
        plan[dst + "mlp.gate_up_proj.weight"] = (
            Part(mlp + "gate_proj.weight", ff, Cut(rows=ff)),
            Part(mlp + "up_proj.weight", ff, Cut(rows=ff)),
        )
        plan[dst + "mlp.down_proj.weight"] = (Part(mlp + "down_proj.weight", h, Cut(cols=ff)),)
    return plan


# Gemma 4's and Gemma 3n's encoders and their projections into the text model, under
# ``model.`` with our modules' names (models/gemma4_vision.py, models/gemma3n_audio.py; Gemma 3n's
# ``embed_vision`` and ``embed_audio`` tables too).
GEMMA_MEDIA_MODULES = ("vision_tower.", "embed_vision.", "audio_tower.", "embed_audio.")


def gemma_media_plan(shapes: dict[str, tuple[int, ...]]) -> Plan:
    """Our Gemma 4 or Gemma 3n encoders' parameters (name -> shape) to their checkpoint names,
    one to one (a clipped projection's bounds are scalars: one row)."""
    return {
        name: (Part("model." + name, shape[0] if shape else 1),)
        for name, shape in shapes.items()
        if name.startswith(GEMMA_MEDIA_MODULES)
    }
