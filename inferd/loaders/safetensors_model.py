"""Load a Hugging Face model directory (kind ``Plain``): ``config.json``, ``*.safetensors``
(one file, or shards with ``model.safetensors.index.json``), ``tokenizer.json``,
``tokenizer_config.json`` (or ``chat_template.jinja``) and ``generation_config.json``.

``load_safetensors_model`` builds the decoder (weights only); ``load_plain_model`` builds the
servable model, engine included, as ``builder.load_model`` does for a GGUF file.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from inferd.layers.rotary import inverse_frequencies
from inferd.loaders.hf_tokenizer import chat_template_source, read_json, tokenizer_from_hf
from inferd.loaders.safetensors import SafetensorsCheckpoint
from inferd.loaders.tokenizer import TokenizerBundle
from inferd.models.config import ModelConfig, ModelConfigError, config_from_hf
from inferd.models.hf_layout import checkpoint_prefix, hf_plan
from inferd.models.llama import LlamaForCausalLM
from inferd.models.weights import WeightSource, build_empty, fill
from inferd.quantize import Isq

if TYPE_CHECKING:
    from inferd.config import EngineConfig
    from inferd.engine.builder import ModelSource, ServedModel
    from inferd.engine.driver import EngineLoop

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
GENERATION_CONFIG = "generation_config.json"


def is_plain_model_directory(path: Path) -> bool:
    """A directory with a config.json naming a decoder architecture we run."""
    from inferd.models.config import HF_MODEL_TYPES

    return path.is_dir() and read_json(path / CONFIG_FILE).get("model_type") in HF_MODEL_TYPES


def read_model_config(directory: Path, checkpoint: SafetensorsCheckpoint) -> ModelConfig:
    hf = read_json(directory / CONFIG_FILE)
    if not hf:
        raise ModelConfigError(f"{directory}: no config.json")
    return config_from_hf(hf, has_lm_head="lm_head.weight" in checkpoint)


def load_safetensors_model(
    directory: str | Path,
    dtype: torch.dtype,
    *,
    progress: bool = True,
    packed_kernels: bool = True,
    isq: Isq | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The decoder of a HF directory, weights in ``dtype`` (see ``weights.fill`` for the rest)."""
    directory = Path(directory)
    checkpoint = SafetensorsCheckpoint(directory)
    cfg = read_model_config(directory, checkpoint)
    inv_freq = inverse_frequencies(cfg.rotary_size, cfg.rope_theta, cfg.rope_scaling)
    model = build_empty(cfg, inv_freq, dtype)
    plan = hf_plan(cfg, checkpoint_prefix(set(checkpoint.names())))
    items = list(plan.items())
    if cfg.tie_word_embeddings:  # after the embedding: a packed copy for decode in bf16
        items.append(("lm_head.weight", plan["embed_tokens.weight"]))

    def read(names: list[str]) -> Callable[[], torch.Tensor]:
        def load() -> torch.Tensor:
            parts = [checkpoint.load_tensor(n).float() for n in names]
            return torch.cat(parts) if len(parts) > 1 else parts[0]

        return load

    missing = [p.name for _, parts in items for p in parts if p.name not in checkpoint]
    if missing:
        raise ModelConfigError(
            f"{directory}: the checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}"
        )
    sources = (WeightSource(t, read([p.name for p in parts])) for t, parts in items)
    fill(
        model,
        sources,
        dtype,
        total=len(items),
        packed_kernels=packed_kernels,
        isq=isq,
        progress=progress,
    )
    return model, cfg


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


def load_plain_model(
    source: ModelSource | str | Path,
    cfg: EngineConfig,
    *,
    progress: bool = True,
    chat_template: str | None = None,
    loop: EngineLoop | None = None,
) -> ServedModel:
    """A servable model from a HF directory (``chat_template``: Jinja source that replaces the
    directory's own; ``loop``: who steps the engine). The same ServedModel as
    ``builder.load_model`` returns for GGUF."""
    from inferd.engine.builder import ModelSource, assemble, resolve_source
    from inferd.loaders.chat_template import CHATML_TEMPLATE, ChatTemplate
    from inferd.models.loader import resolve_dtype
    from inferd.quantize import isq_for

    if not isinstance(source, ModelSource):
        source = resolve_source(str(source))
    directory = source.path
    if not directory.is_dir():
        raise ModelConfigError(f"{directory}: a Plain model must be a directory")
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)
    dtype = resolve_dtype(cfg.dtype)
    isq = isq_for(cfg.isq, source.digest)
    model, mcfg = load_safetensors_model(
        directory, dtype, progress=progress, packed_kernels=cfg.packed_kernels, isq=isq
    )
    tokenizer = load_tokenizer(directory, mcfg)
    template_source = chat_template or chat_template_source(directory)
    if template_source is None:
        log.warning("%s has no chat template; using ChatML", directory)
        template_source = CHATML_TEMPLATE
    template = ChatTemplate(template_source, tokenizer.bos_token or "", tokenizer.eos_token or "")
    return assemble(
        source,
        cfg,
        model,
        mcfg,
        dtype,
        tokenizer,
        template,
        stop_ids=generation_stop_ids(directory),
        isq=isq,
        loop=loop,
    )
