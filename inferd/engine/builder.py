"""Turn a model source (a .gguf path or a store name) into a running, servable model."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from inferd import kernels
from inferd.config import EngineConfig
from inferd.engine.async_engine import AsyncEngine, TextCodec
from inferd.engine.core import EngineCore
from inferd.engine.driver import EngineLoop, ThreadLoop
from inferd.engine.kv_cache import KVCacheManager
from inferd.engine.llm_engine import LLMEngine
from inferd.engine.runner import ModelRunner
from inferd.engine.scheduler import Scheduler, SchedulerConfig
from inferd.loaders.chat_template import ChatTemplate, RenderedChat, literal_text
from inferd.loaders.gguf import GGUFFile
from inferd.loaders.tokenizer import TokenizerBundle, tokenizer_from_gguf
from inferd.models.config import ModelConfig
from inferd.models.llama import LlamaForCausalLM
from inferd.models.loader import load_gguf_model, resolve_dtype
from inferd.quantize import Isq, isq_for
from inferd.store import CATALOG, ModelStore, StoreError, sha256_file

log = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 8192


@dataclass(frozen=True, slots=True)
class ModelSource:
    name: str  # the id the API serves it under
    path: Path
    digest: str
    revision: str | None = None  # the commit, for a Hugging Face cache snapshot
    file_digests: tuple[tuple[str, str], ...] = ()  # (relpath, sha256) of a HF snapshot


def resolve_source(
    source: str, store: ModelStore | None = None, *, revision: str | None = None
) -> ModelSource:
    """A path to a .gguf file or a model directory, a store name (pulled first when
    missing), or a Hugging Face repo id ``org/name[@revision]`` found in the local HF cache
    (``revision`` given separately wins over one in the string)."""
    from inferd.hf_cache import is_repo_id, resolve_snapshot, split_revision

    if is_repo_id(source) and source not in CATALOG:
        repo_id, rev = split_revision(source)
        snap = resolve_snapshot(repo_id, revision or rev)
        return ModelSource(
            name=source,
            path=snap.entry,
            digest=snap.digest,
            revision=snap.revision,
            file_digests=tuple(sorted(snap.files.items())),
        )
    path = Path(source).expanduser()
    if path.is_file():
        return ModelSource(name=path.stem, path=path.resolve(), digest=sha256_file(path))
    if path.is_dir():
        return ModelSource(name=path.name, path=path.resolve(), digest=directory_digest(path))
    store = store or ModelStore()
    if source in CATALOG:
        entry = store.entry_path(source)
        if entry is None:
            log.info("model %s is not in the store yet; pulling it", source)
            store.pull(source)
            entry = store.entry_path(source)
        manifest = store.manifest(source)
        assert entry is not None and manifest is not None
        return ModelSource(name=source, path=entry, digest=manifest.digest)
    raise StoreError(
        f"model {source!r} is neither a file nor a store name (nor a directory); pass a path "
        f"to a .gguf file or a model directory, or one of: {', '.join(sorted(CATALOG))} "
        "(see `inferd pull`)"
    )


def directory_digest(path: Path) -> str:
    """One digest for a model directory, computed as the store's manifests do: sha256 over the
    sorted ``relpath:sha256`` lines of its files (hidden files aside)."""
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    joined = "\n".join(f"{p.relative_to(path).as_posix()}:{sha256_file(p)}" for p in files)
    return hashlib.sha256(joined.encode()).hexdigest()


@dataclass(slots=True)
class ServedModel:
    """A loaded model and everything the server needs to answer for it."""

    kind: ClassVar[str] = "chat"  # generates text; EmbeddingModel's kind is "embedding"

    source: ModelSource
    config: ModelConfig
    dtype: torch.dtype
    tokenizer: TokenizerBundle
    chat_template: ChatTemplate
    engine: AsyncEngine
    engine_config: EngineConfig
    kv_cache_tokens: int
    created: int
    isq: str | None = None  # in-situ quantization method (q8 | q4), when asked for (--isq)

    @property
    def id(self) -> str:
        return self.source.name

    def chat_prompt(
        self, messages: list[dict[str, Any]], *, special_in_content: bool = False
    ) -> list[int]:
        """Token ids of the conversation, ready for the assistant's turn."""
        rendered = self.render_chat(messages, special_in_content=special_in_content)
        return self.tokenizer.encode(
            rendered.text, add_special=True, literal_spans=rendered.literal_spans
        )

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        prefill: str = "",
        special_in_content: bool = False,
    ) -> RenderedChat:
        """The prompt text, then ``prefill`` (the start of the reply). Special-token text in the
        messages or the prefill stays plain text (only the template makes control tokens)
        unless ``special_in_content``."""
        special = None if special_in_content else self.tokenizer.special_token_pattern
        rendered = self.chat_template.render_chat(
            messages, special=special, add_generation_prompt=add_generation_prompt
        )
        return rendered + literal_text(prefill, special) if prefill else rendered

    def shutdown(self) -> None:
        self.engine.shutdown()


def load_model(
    source: ModelSource,
    cfg: EngineConfig,
    *,
    progress: bool = True,
    chat_template: str | None = None,
    loop: EngineLoop | None = None,
) -> ServedModel:
    """A .gguf file, or a Hugging Face directory (``load_plain_model``).

    ``chat_template``: Jinja source that replaces the model's own template. ``loop``: who steps
    the engine (engine/driver.py); by default a thread of its own."""
    started = time.perf_counter()
    if source.path.is_dir():
        from inferd.loaders.safetensors_model import load_plain_model

        served = load_plain_model(
            source, cfg, progress=progress, chat_template=chat_template, loop=loop
        )
    else:
        served = _load_gguf(source, cfg, progress=progress, chat_template=chat_template, loop=loop)
    log.info("loaded %s in %.1fs", source.name, time.perf_counter() - started)
    return served


def _load_gguf(
    source: ModelSource,
    cfg: EngineConfig,
    *,
    progress: bool,
    chat_template: str | None,
    loop: EngineLoop | None,
) -> ServedModel:
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)
    gguf = GGUFFile(source.path)
    dtype = resolve_dtype(cfg.dtype)
    isq = isq_for(cfg.isq, source.digest)
    model, mcfg = load_gguf_model(
        gguf, dtype, progress=progress, packed_kernels=cfg.packed_kernels, isq=isq
    )
    tokenizer = tokenizer_from_gguf(gguf.metadata)
    template = ChatTemplate.from_metadata(
        gguf.metadata, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token
    )
    if chat_template is not None:
        template = ChatTemplate(chat_template, template.bos_token, template.eos_token)
    return assemble(source, cfg, model, mcfg, dtype, tokenizer, template, isq=isq, loop=loop)


def assemble(
    source: ModelSource,
    cfg: EngineConfig,
    model: LlamaForCausalLM,
    mcfg: ModelConfig,
    dtype: torch.dtype,
    tokenizer: TokenizerBundle,
    template: ChatTemplate,
    *,
    stop_ids: Sequence[int] = (),
    isq: Isq | None = None,
    loop: EngineLoop | None = None,
) -> ServedModel:
    """The engine (KV cache, scheduler, runner) around a loaded model, as a ServedModel.
    ``stop_ids``: end-of-sequence ids beyond the tokenizer's EOS and the template's markers.
    ``loop``: who steps the engine; by default a thread of its own."""
    model.use_kernels(kernels.load_ops(dtype))  # built now (once per machine), not mid-request
    max_len = cfg.max_model_len or min(mcfg.max_position, DEFAULT_MAX_MODEL_LEN)
    kv_tokens = _kv_cache_tokens(cfg, mcfg, dtype)
    num_blocks = kv_tokens // cfg.block_size + 1  # +1: the reserved null block
    runner = ModelRunner(model, mcfg, num_blocks, cfg.block_size, dtype)
    scheduler = Scheduler(
        SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_waiting),
        KVCacheManager(
            num_blocks,
            cfg.block_size,
            prefix_caching=cfg.prefix_caching,
            model_key=source.digest,
        ),
    )
    stops = [tokenizer.tokenizer.token_to_id(t) for t in template.end_of_turn_tokens()]
    eos = {i for i in [tokenizer.eos_token_id, *stops, *stop_ids] if i is not None}
    codec = TextCodec(tokenizer.id_to_bytes, tokenizer.special_ids, frozenset(eos))
    engine = AsyncEngine(
        LLMEngine(EngineCore(runner, scheduler, max_len), codec),
        loop or ThreadLoop(),
        cfg.max_waiting,
    )
    return ServedModel(
        source=source,
        config=mcfg,
        dtype=dtype,
        tokenizer=tokenizer,
        chat_template=template,
        engine=engine,
        engine_config=cfg,
        kv_cache_tokens=(num_blocks - 1) * cfg.block_size,
        created=int(time.time()),
        isq=isq.method if isq is not None else None,
    )


def _kv_cache_tokens(cfg: EngineConfig, mcfg: ModelConfig, dtype: torch.dtype) -> int:
    if cfg.kv_cache_tokens is not None:
        tokens = cfg.kv_cache_tokens
    else:
        per_token = mcfg.kv_bytes_per_token * dtype.itemsize // 4
        budget_mb = cfg.kv_cache_mb or min(512, _available_mb() // 10)
        tokens = budget_mb * 2**20 // per_token
    return max(cfg.block_size, tokens // cfg.block_size * cfg.block_size)


def _available_mb() -> int:
    """Memory the OS can give without swapping (MemAvailable), or a modest guess elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 4096
