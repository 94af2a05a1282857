"""inferd inside other applications: ``Engine``, one model driven from Python without HTTP.

    engine = Engine.from_spec("smollm2", max_seqs=4)   # starts loading in the background
    await engine.load()                                 # or: engine = await Engine.from_spec(...)
    reply = await engine.chat([{"role": "user", "content": "Hi"}], max_tokens=32)
    async for delta in engine.generate(prompt="Once upon a time", max_tokens=16):
        print(delta.text, end="")
    vectors = (await Engine.from_spec("minilm").load()).embed(["a", "b"])   # awaitable

Engines can also be served: ``inferd.server.build_app([engine, ...])`` returns an ASGI app to
mount under any path of a FastAPI or Starlette application; the app and the Python calls
share the same loaded model, engine thread and KV pool.

Loading runs on a loader thread; ``on_progress`` receives a LoadEvent at each step (loading,
then loaded or error) and ``progress_bar=True`` shows the weight loading on stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import uuid
from collections.abc import AsyncIterator, Generator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from inferd.config import EngineConfig
from inferd.engine.driver import EngineLoop
from inferd.engine.embedding import EmbeddingModel
from inferd.engine.sampling import SamplingParams
from inferd.serving.loading import Servable, expected_kind, load_spec
from inferd.serving.registry import (
    ConflictError,
    LoadEvent,
    ModelSlot,
    ModelStatus,
    ProgressCallback,
    RequantizeReport,
    UnavailableError,
    UnloadReport,
)
from inferd.serving.served import ServedModel
from inferd.serving.spec import ModelSpec, load_models_file

__all__ = [
    "ChatResult",
    "Delta",
    "EmbeddingResult",
    "Engine",
    "EngineError",
    "LoadEvent",
    "ModelSpec",
    "Usage",
]


class EngineError(RuntimeError):
    """The model is not available (failed to load, unloaded), or a generation failed."""


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Delta:
    """New output of a generation: text released since the last delta, and its tokens."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None  # None until the last delta: "stop" or "length"


@dataclass(frozen=True, slots=True)
class ChatResult:
    model: str
    text: str
    finish_reason: str
    usage: Usage


@dataclass(frozen=True, slots=True)
class EmbeddingResult:
    model: str
    vectors: list[list[float]]
    usage: Usage


class Engine:
    """One model. Create with ``from_spec`` (loads in the background) or ``from_model``."""

    def __init__(self, slot: ModelSlot) -> None:
        self.slot = slot

    # -- building ---------------------------------------------------------------------------
    @classmethod
    def from_spec(
        cls,
        spec: str | Path | ModelSpec,
        *,
        engine_config: EngineConfig | None = None,
        on_progress: ProgressCallback | None = None,
        progress_bar: bool = False,
        load: bool = True,
        loop: EngineLoop | None = None,
        **fields: Any,
    ) -> Engine:
        """An engine for a store name, a .gguf file or a model directory (or a ModelSpec);
        ``fields`` set ModelSpec fields (``alias``, ``dtype``, ``max_seq_len``, ``max_seqs``,
        ``kind``, ``chat_template``...). Loading starts now unless ``load`` is False.
        ``loop`` steps the model (engine/driver.py): by default a thread of its own; pass a
        ``MainThreadDriver`` and run it on the main thread to step there instead."""
        if isinstance(spec, ModelSpec):
            spec = replace(spec, **fields)
        else:
            spec = ModelSpec(model_id=str(spec), **fields)
        cfg = engine_config or EngineConfig()
        slot = ModelSlot(
            spec.api_id,
            expected_kind(spec),
            functools.partial(load_spec, spec, cfg, progress=progress_bar, loop=loop),
            label=spec.label,
            on_progress=on_progress,
        )
        engine = cls(slot)
        if load:
            slot.start_loading()
        return engine

    @classmethod
    def from_config_file(cls, path: str | Path, **options: Any) -> list[Engine]:
        """One engine per model of a models file (JSON or TOML, as `inferd serve --config`)."""
        return [cls.from_spec(spec, **options) for spec in load_models_file(path)]

    @classmethod
    def from_model(cls, model: Servable) -> Engine:
        """An engine around a model loaded already (it cannot be reloaded once unloaded)."""
        return cls(ModelSlot.of_loaded(model))

    # -- state ------------------------------------------------------------------------------
    @property
    def id(self) -> str:
        return self.slot.id

    @property
    def kind(self) -> str:
        return self.slot.kind

    @property
    def status(self) -> ModelStatus:
        return self.slot.status

    @property
    def error(self) -> str | None:
        return self.slot.error

    @property
    def model(self) -> Servable:
        """The loaded model; EngineError when it is not loaded."""
        model = self.slot.model
        if self.slot.status is not ModelStatus.LOADED or model is None:
            raise EngineError(f"the model {self.id!r} is {self.slot.status}")
        return model

    async def load(self) -> Engine:
        """Wait until the model is loaded (starting the load if needed)."""
        try:
            await self.slot.ensure_loaded(auto_reload=True)
        except UnavailableError as exc:
            raise EngineError(str(exc)) from None
        return self

    def __await__(self) -> Generator[Any, None, Engine]:
        return self.load().__await__()

    def wait(self, timeout: float | None = None) -> Engine:
        """Block until loaded, for code without an event loop."""
        future = self.slot._future
        if future is None and self.slot.status is ModelStatus.UNLOADED:
            future = self.slot.start_loading()
        if future is not None:
            with contextlib.suppress(Exception):  # a failed load: self.model says why
                future.result(timeout)
        self.model  # noqa: B018 - raises EngineError unless loaded
        return self

    async def unload(self, drain_timeout: float = 30.0) -> UnloadReport:
        """Free the model after running requests finish (aborting those left at the
        deadline). A later call loads it again."""
        try:
            return await self.slot.unload(drain_timeout)
        except ConflictError as exc:
            raise EngineError(str(exc)) from None

    async def requantize(self, method: str, drain_timeout: float = 30.0) -> RequantizeReport:
        """Quantize the model's projections again, q8 or q4, from its files, while it serves
        on; then hold new requests, let the running ones finish (for up to ``drain_timeout``
        seconds) and swap (``ModelSlot.requantize``). EngineError, nothing changed, when it
        cannot."""
        try:
            return await self.slot.requantize(method, drain_timeout)
        except (ConflictError, ValueError) as exc:  # QuantizeError: an unknown method
            raise EngineError(str(exc)) from None

    def shutdown(self) -> None:
        self.slot.shutdown()

    async def __aenter__(self) -> Engine:
        return await self.load()

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.shutdown)

    # -- generating -------------------------------------------------------------------------
    async def generate(
        self,
        messages: Sequence[Mapping[str, Any]] | None = None,
        *,
        prompt: str | Sequence[int] | None = None,
        params: SamplingParams | None = None,
        **sampling: Any,
    ) -> AsyncIterator[Delta]:
        """Stream a reply to chat ``messages`` (through the chat template), or a continuation
        of ``prompt`` (text or token ids). ``sampling`` are SamplingParams fields
        (``max_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed``...)."""
        model = await self._chat_model()
        ids = await self._prompt_ids(model, messages, prompt)
        params = _params(params, sampling, model.engine.room(len(ids)))
        model.engine.check_admission(len(ids), params)
        rid = f"api-{uuid.uuid4().hex[:12]}"
        async for out in model.engine.generate(ids, params, request_id=rid):
            if out.finish_reason in ("error", "abort"):
                raise EngineError(out.error or f"the generation ended with {out.finish_reason}")
            yield Delta(out.text, out.token_ids, out.finish_reason)

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        params: SamplingParams | None = None,
        **sampling: Any,
    ) -> ChatResult:
        """The whole reply to chat ``messages``."""
        model = await self._chat_model()
        ids = await self._prompt_ids(model, messages, None)
        params = _params(params, sampling, model.engine.room(len(ids)))
        model.engine.check_admission(len(ids), params)
        parts: list[str] = []
        finish, completion = "stop", 0
        async for out in model.engine.generate(ids, params):
            if out.finish_reason in ("error", "abort"):
                raise EngineError(out.error or f"the generation ended with {out.finish_reason}")
            parts.append(out.text)
            completion = out.num_output_tokens
            finish = out.finish_reason or finish
        return ChatResult(model.id, "".join(parts), finish, Usage(len(ids), completion))

    async def embed(
        self, inputs: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]
    ) -> EmbeddingResult:
        """One vector per input: a text, texts, token ids or lists of token ids."""
        await self.load()
        embedder = self.model
        if not isinstance(embedder, EmbeddingModel):
            raise EngineError(
                f"the model {self.id!r} is a chat model; embed needs an embedding model"
            )
        items: list[Any] = [inputs] if isinstance(inputs, str) else list(inputs)
        if not items:
            raise ValueError("nothing to embed")
        if all(isinstance(x, str) for x in items):
            ids = await asyncio.to_thread(embedder.tokenize, items)
        elif all(isinstance(x, int) for x in items):
            ids = [[int(x) for x in items]]
        else:
            ids = [[int(t) for t in x] for x in items]
        vectors = await embedder.embed_async(ids)
        return EmbeddingResult(embedder.id, vectors, Usage(sum(len(x) for x in ids)))

    async def _chat_model(self) -> ServedModel:
        await self.load()
        model = self.model
        if not isinstance(model, ServedModel):
            raise EngineError(f"the model {self.id!r} is an embedding model; it cannot generate")
        return model

    @staticmethod
    async def _prompt_ids(
        model: ServedModel,
        messages: Sequence[Mapping[str, Any]] | None,
        prompt: str | Sequence[int] | None,
    ) -> list[int]:
        if (messages is None) == (prompt is None):
            raise ValueError("give messages or prompt, not both or neither")
        if messages is not None:
            chat = await asyncio.to_thread(model.chat_prompt, [dict(m) for m in messages])
            return chat.ids
        if isinstance(prompt, str):
            return model.tokenizer.encode(prompt, add_special=True)
        assert prompt is not None
        return [int(t) for t in prompt]


def _params(params: SamplingParams | None, sampling: dict[str, Any], room: int) -> SamplingParams:
    """The request's params; without max_tokens, SamplingParams' default within the ``room``
    the prompt leaves (at least 1: a prompt that leaves none is refused at admission)."""
    if "stop" in sampling and isinstance(sampling["stop"], str):
        sampling["stop"] = (sampling["stop"],)
    elif "stop" in sampling:
        sampling["stop"] = tuple(sampling["stop"])
    if params is None:
        if "max_tokens" not in sampling:
            sampling["max_tokens"] = max(1, min(SamplingParams().max_tokens, room))
        return SamplingParams(**sampling)
    return replace(params, **sampling)
