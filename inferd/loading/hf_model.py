"""Load a Hugging Face model directory (kind ``Plain``): ``config.json``, ``*.safetensors``
(one file, or shards with ``model.safetensors.index.json``), ``tokenizer.json``,
``tokenizer_config.json`` (or ``chat_template.jinja``) and ``generation_config.json``.

``load_safetensors_model`` builds the decoder (weights only); ``loading.model.load`` adds the
tokenizer, chat template and stop ids, as it does for a GGUF file.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from inferd.layers.rotary import RotaryEmbedding, inverse_frequencies
from inferd.loading.hf_layout import (
    IDEFICS3_TEXT_PREFIX,
    Part,
    audio_plan,
    checkpoint_prefix,
    gemma3_vision_plan,
    gemma3n_plan,
    gemma4_plan,
    gemma_media_plan,
    hf_plan,
    qwen2_audio_text_plan,
    qwen_vl_plan,
    vision_plan,
)
from inferd.loading.hf_tokenizer import read_json, tokenizer_from_hf
from inferd.loading.matformer import MatformerSlice, sliced_model_config
from inferd.loading.quantize import Isq
from inferd.loading.safetensors import SafetensorsCheckpoint
from inferd.loading.tokenizer import TokenizerBundle
from inferd.loading.weights import WeightSource, build_empty, fill
from inferd.models.config import HF_MODEL_TYPES, ModelConfig, ModelConfigError, config_from_hf
from inferd.models.gemma4 import gemma4_rotaries
from inferd.models.gemma4_assistant import AssistantConfig, Gemma4AssistantForCausalLM
from inferd.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
GENERATION_CONFIG = "generation_config.json"


def is_plain_model_directory(path: Path) -> bool:
    """A directory with a config.json naming a decoder architecture we run."""
    return path.is_dir() and read_json(path / CONFIG_FILE).get("model_type") in HF_MODEL_TYPES


def merged_config(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` merged in recursively: an object merges into an object,
    any other value (a list, a number, null) replaces what was there."""
    merged = dict(base)
    for key, value in overrides.items():
        old = merged.get(key)
        if isinstance(value, Mapping) and isinstance(old, Mapping):
            merged[key] = merged_config(old, value)
        else:
            merged[key] = value
    return merged


def read_model_config(
    directory: Path,
    checkpoint: SafetensorsCheckpoint,
    overrides: Mapping[str, Any] | None = None,
    matformer: MatformerSlice | None = None,
) -> ModelConfig:
    """The model's config.json, with ``overrides`` (--hf-config-overrides) merged in, and
    sliced (a Gemma 3n MatFormer slice, --matformer-slice)."""
    hf = read_json(directory / CONFIG_FILE)
    if not hf:
        raise ModelConfigError(f"{directory}: no config.json")
    if overrides:
        hf = merged_config(hf, overrides)
    # Qwen2-Audio's published checkpoints keep the head under its text model's name.
    heads = ("lm_head.weight", "language_model.lm_head.weight")  # (Gemma 3's too)
    has_lm_head = any(h in checkpoint for h in heads)
    if matformer is not None:
        cfg = sliced_model_config(hf, matformer, has_lm_head=has_lm_head)
    else:
        cfg = config_from_hf(hf, has_lm_head=has_lm_head)
    return without_absent_vision(cfg, checkpoint)


GEMMA3N_VISION_STEM = "model.vision_tower.timm_model.conv_stem.conv.weight"


def without_absent_vision(cfg: ModelConfig, checkpoint: SafetensorsCheckpoint) -> ModelConfig:
    """A Gemma 3n config whose checkpoint has no MobileNet-v5 weights (a text and audio
    export; transformers writes a default vision_config all the same) with its image encoder
    unserved."""
    g = cfg.gemma3n
    if cfg.gemma3n_vision is None or g is None or GEMMA3N_VISION_STEM in checkpoint:
        return cfg
    return replace(cfg, gemma3n_vision=None, gemma3n=replace(g, unserved_media=("image",)))


def load_safetensors_model(
    directory: str | Path,
    dtype: torch.dtype,
    *,
    progress: bool = True,
    packed_kernels: bool = True,
    isq: Isq | None = None,
    config_overrides: Mapping[str, Any] | None = None,
    matformer: MatformerSlice | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The decoder of a HF directory, weights in ``dtype`` (see ``weights.fill`` for the rest);
    ``config_overrides`` merged into its config.json; ``matformer``: the slice of a Gemma 3n
    checkpoint to build (loading/matformer.py)."""
    directory = Path(directory)
    checkpoint = SafetensorsCheckpoint(directory)
    cfg = read_model_config(directory, checkpoint, config_overrides, matformer)
    inv_freq = inverse_frequencies(cfg.rotary_size, cfg.rope_theta, cfg.rope_scaling)
    model = build_empty(cfg, inv_freq, dtype)
    sources = decoder_sources(directory, checkpoint, model)
    fill(
        model,
        sources,
        dtype,
        total=len(sources),
        packed_kernels=packed_kernels,
        isq=isq,
        progress=progress,
    )
    return model, cfg


def decoder_sources(
    directory: Path, checkpoint: SafetensorsCheckpoint, model: LlamaForCausalLM
) -> list[WeightSource]:
    """Each parameter of ``model`` (built from the checkpoint's config; its media encoders'
    parameters are named after it) and its reader from the checkpoint."""
    cfg = model.config
    names = set(checkpoint.names())
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    rows = {n: shape[0] for n, shape in shapes.items() if shape}  # (scalars: Gemma 4 alone)
    if cfg.gemma4 is not None:  # Gemma 4 and Gemma 3n
        plan = gemma3n_plan(cfg, names) if cfg.gemma3n is not None else gemma4_plan(cfg, names)
        plan |= gemma_media_plan(shapes)
    elif cfg.vision is not None and cfg.vision.pooled:
        plan = gemma3_vision_plan(cfg, rows, names)
    elif cfg.vision is not None:
        plan = hf_plan(cfg, IDEFICS3_TEXT_PREFIX) | vision_plan(rows)
    elif cfg.qwen_vision is not None:
        plan = qwen_vl_plan(cfg, rows, names)
    elif cfg.audio is not None:
        plan = qwen2_audio_text_plan(cfg, names) | audio_plan(rows, names)
    else:
        plan = hf_plan(cfg, checkpoint_prefix(names))
    items = list(plan.items())
    if cfg.tie_word_embeddings:  # after the embedding: a packed copy for decode in bf16
        items.append(("lm_head.weight", plan["embed_tokens.weight"]))
    return weight_sources(directory, checkpoint, items)


def weight_sources(
    directory: Path, checkpoint: SafetensorsCheckpoint, items: list[tuple[str, tuple[Part, ...]]]
) -> list[WeightSource]:
    """Each parameter's reader from the checkpoint tensors its plan names (cut and joined);
    ModelConfigError, before anything is read, when the checkpoint lacks one of them."""
    missing = [p.name for _, parts in items for p in parts if p.name not in checkpoint]
    if missing:
        raise ModelConfigError(
            f"{directory}: the checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}"
        )

    def read(parts: tuple[Part, ...]) -> Callable[[], torch.Tensor]:
        def load() -> torch.Tensor:
            tensors = [p.take(checkpoint.load_tensor(p.name).float()) for p in parts]
            return torch.cat(tensors) if len(tensors) > 1 else tensors[0]

        return load

    return [WeightSource(target, read(parts)) for target, parts in items]


def is_gemma4_assistant(directory: str | Path) -> bool:
    """A directory holding Gemma 4's drafting assistant (``--speculative draft`` takes it)."""
    return read_json(Path(directory) / CONFIG_FILE).get("model_type") == "gemma4_assistant"


def load_gemma4_assistant(
    directory: str | Path, dtype: torch.dtype, *, progress: bool = True
) -> Gemma4AssistantForCausalLM:
    """Gemma 4's drafting assistant (models/gemma4_assistant.py), weights in ``dtype``."""
    directory = Path(directory)
    checkpoint = SafetensorsCheckpoint(directory)
    cfg = AssistantConfig.from_hf(read_json(directory / CONFIG_FILE))
    text = cfg.text
    rows = min(text.max_position, 4096)  # the served model's context covers it later
    global_rotary, local_rotary = gemma4_rotaries(text, rows)
    with torch.device("meta"):
        placeholder = RotaryEmbedding(text.head_dim, 1, torch.zeros(text.head_dim // 2))
        model = Gemma4AssistantForCausalLM(cfg, placeholder).to(dtype)
    model.rotary, model.local_rotary = global_rotary, local_rotary
    plan = gemma4_plan(text, set(checkpoint.names()))
    plan["pre_projection.weight"] = (Part("pre_projection.weight", text.hidden_size),)
    plan["post_projection.weight"] = (Part("post_projection.weight", cfg.backbone_hidden_size),)
    if cfg.ordered_embeddings:
        plan["centroids.weight"] = (Part("masked_embedding.centroids.weight", cfg.num_centroids),)
    items = [*plan.items(), ("lm_head.weight", plan["embed_tokens.weight"])]
    sources = weight_sources(directory, checkpoint, items)
    fill(model, sources, dtype, total=len(items), packed_kernels=False, progress=progress)
    if cfg.ordered_embeddings:
        model.token_ordering = checkpoint.load_tensor("masked_embedding.token_ordering").long()
    return model


def generation_stop_ids(directory: Path) -> list[int]:
    """EOS ids from generation_config.json (an int or a list), else config.json."""
    for name in (GENERATION_CONFIG, CONFIG_FILE):
        value: Any = read_json(directory / name).get("eos_token_id")
        if isinstance(value, int):
            return [value]
        if isinstance(value, list) and value:
            return [int(v) for v in value]
    return []


def load_tokenizer(directory: Path, cfg: ModelConfig) -> TokenizerBundle:
    stops = generation_stop_ids(directory)
    return tokenizer_from_hf(
        directory, vocab_size=cfg.vocab_size, eos_token_id=stops[0] if stops else None
    )
