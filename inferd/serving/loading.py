"""Load a ModelSpec into a servable model of its kind.

Kinds of served model:

- ``chat``: a generative model (``ServedModel``): chat, completions, messages.
- ``embedding``: a sentence-embedding model (``EmbeddingModel``): /v1/embeddings.

A spec's kind (GGUF, Plain, Embedding, or auto for `-m`) picks the loader: GGUF files and
Plain (Hugging Face safetensors) directories load through ``served.load_model`` (which calls
``loading.model.load``), embedding directories through ``load_embedding_model``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Literal, Protocol, TypeVar

import torch

from inferd.config import EngineConfig
from inferd.engine.driver import EngineLoop, ThreadLoop
from inferd.engine.embedding import EmbeddingModel, Pooling
from inferd.loading.bert import is_embedding_directory, load_bert
from inferd.serving.served import ServedModel, load_model
from inferd.serving.spec import ModelSpec
from inferd.source import ModelSource, resolve_source
from inferd.store import CATALOG, ModelStore, StoreError

_T = TypeVar("_T")

log = logging.getLogger(__name__)

ModelKind = Literal["chat", "embedding"]
Servable = ServedModel | EmbeddingModel


class ServableModel(Protocol):
    """What the server needs of any loaded model, whatever its kind."""

    @property
    def id(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def created(self) -> int: ...

    def shutdown(self) -> None: ...


class ModelLoadError(ValueError):
    """A model that could not be loaded; the message says why (and, where known, what to do).
    A ValueError, as the cause is nearly always what the spec points at."""


def expected_kind(spec: ModelSpec) -> ModelKind:
    """The kind a spec will load as, known without loading it."""
    if spec.kind == "Embedding":
        return "embedding"
    if spec.kind in ("GGUF", "Plain", "VisionPlain"):
        return "chat"
    path = Path(spec.model_id).expanduser()
    if path.is_dir():
        return "embedding" if is_embedding_directory(path) else "chat"
    if not path.exists() and spec.model_id in CATALOG:
        return "embedding" if CATALOG[spec.model_id].kind == "directory" else "chat"
    return "chat"


def load_spec(
    spec: ModelSpec,
    base: EngineConfig,
    *,
    progress: bool = False,
    loop: EngineLoop | None = None,
) -> Servable:
    """Load ``spec``; engine settings not in the spec come from ``base``. ``loop`` steps the
    model's engine (engine/driver.py); by default a thread of its own."""
    try:
        return _load(spec, base, progress, loop)
    except ModelLoadError:
        raise
    except (ValueError, StoreError) as exc:  # their messages say what is wrong
        raise ModelLoadError(str(exc)) from exc
    except (OSError, KeyError) as exc:
        raise ModelLoadError(f"{type(exc).__name__}: {exc}") from exc


def _load(spec: ModelSpec, base: EngineConfig, progress: bool, loop: EngineLoop | None) -> Servable:
    source = resolve_spec_source(spec)
    kind = spec.kind if spec.kind != "auto" else _detect_kind(source.path)
    if kind == "Embedding":
        return _load_embedding(spec, source, loop)
    if kind == "GGUF" and not source.path.is_file():
        raise ModelLoadError(f"{source.path}: a GGUF model must be a .gguf file")
    if spec.mmproj is not None and kind != "GGUF":
        raise ModelLoadError(
            f"{source.path}: --mmproj goes with a GGUF language model; a Hugging Face "
            "directory carries its own vision encoder"
        )
    if kind in ("Plain", "VisionPlain") and not source.path.is_dir():
        raise ModelLoadError(
            f"{source.path}: a {kind} model must be a directory (config.json, *.safetensors, "
            "tokenizer.json)"
        )
    cfg = replace(
        base,
        dtype=spec.dtype or base.dtype,
        max_model_len=spec.max_seq_len or base.max_model_len,
        max_num_seqs=spec.max_seqs or base.max_num_seqs,
        isq=spec.in_situ_quant or base.isq,
        kv_cache_dtype=spec.kv_cache_dtype or base.kv_cache_dtype,
        imatrix=spec.imatrix or base.imatrix,
        prefix_cache_n=_given(spec.prefix_cache_n, base.prefix_cache_n),
        max_decode_steps_before_prefill=_given(
            spec.max_decode_steps_before_prefill, base.max_decode_steps_before_prefill
        ),
        no_kv_cache=_given(spec.no_kv_cache, base.no_kv_cache),
    )
    model = load_model(
        source,
        cfg,
        progress=progress,
        chat_template=spec.chat_template,
        loop=loop,
        tool_call_parser=spec.tool_call_parser,
        mmproj=spec.mmproj,
        config_overrides=spec.config_overrides,
        matformer=spec.matformer,
    )
    if kind == "VisionPlain" and model.prompter.modalities == ("text",):
        model.shutdown()
        raise ModelLoadError(
            f"{source.path}: VisionPlain names a model that reads images, audio or video; "
            f"this {model.config.architecture} model reads text only (use Plain)"
        )
    return model


def _given(value: _T | None, default: _T) -> _T:
    """A model's own setting where its entry gives one (0 and false included), else the
    server's."""
    return default if value is None else value


def _load_embedding(
    spec: ModelSpec, source: ModelSource, loop: EngineLoop | None
) -> EmbeddingModel:
    if not source.path.is_dir():
        raise ModelLoadError(
            f"{source.path}: an Embedding model must be a directory (config.json, "
            "model.safetensors, tokenizer.json)"
        )
    model = load_embedding_model(source, spec.dtype or "auto", loop)
    if spec.max_seq_len is not None:
        if spec.max_seq_len > model.config.max_position:
            raise ModelLoadError(
                f"max_seq_len {spec.max_seq_len} exceeds the model's "
                f"{model.config.max_position} positions"
            )
        model.max_input_tokens = spec.max_seq_len
    if spec.max_seqs is not None:
        model.sub_batch = spec.max_seqs
    return model


def resolve_spec_source(spec: ModelSpec, store: ModelStore | None = None) -> ModelSource:
    """The files of ``spec``, named by its API id."""
    if spec.filename is None:
        source = resolve_source(spec.model_id, store)
    else:
        holder = resolve_source(spec.model_id, store)
        if holder.path.is_file():
            if holder.path.name != spec.filename:
                raise ModelLoadError(
                    f"{spec.model_id} holds {holder.path.name}, not {spec.filename}"
                )
            source = holder
        else:
            path = (holder.path / spec.filename).resolve()
            if not path.is_relative_to(holder.path.resolve()):
                raise ModelLoadError(f"quantized_filename {spec.filename!r} leaves {spec.model_id}")
            if not path.is_file():
                raise ModelLoadError(f"{spec.model_id} has no file {spec.filename}")
            source = resolve_source(str(path), store)
    return replace(source, name=spec.api_id)


def _detect_kind(path: Path) -> str:
    if path.is_dir():
        return "Embedding" if is_embedding_directory(path) else "Plain"
    return "GGUF"


def load_embedding_model(
    source: ModelSource, dtype: str = "auto", loop: EngineLoop | None = None
) -> EmbeddingModel:
    """Load the embedding model in directory ``source.path``; ``dtype`` auto means float32 (the
    model is small, and float32 keeps vectors equal to the reference implementation's).
    ``loop``: who runs its forward passes (engine/driver.py); by default a thread of its own."""
    from tokenizers import Tokenizer

    started = time.perf_counter()
    path = source.path
    if not is_embedding_directory(path):
        raise ValueError(f"{path}: not an embedding model directory (a BERT config.json)")
    torch_dtype = {
        "auto": torch.float32,
        "f32": torch.float32,
        "bf16": torch.bfloat16,
        "f16": torch.float16,
    }[dtype]
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise ValueError(f"{path}: no tokenizer.json beside the weights")
    tokenizer = Tokenizer.from_file(str(tok_file))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    model = load_bert(path, torch_dtype)
    pooling = Pooling.from_directory(path)
    log.info("loaded %s in %.1fs", source.name, time.perf_counter() - started)
    return EmbeddingModel(
        source=source,
        config=model.config,
        model=model,
        tokenizer=tokenizer,
        pooling=pooling,
        dtype=torch_dtype,
        loop=loop or ThreadLoop("inferd-embed"),
    )
