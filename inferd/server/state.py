"""What the running server knows: its models and settings."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from inferd.agent.tools import ToolSource
from inferd.server.agent_runtime import AgentRuntime
from inferd.server.agent_sessions import SessionStore
from inferd.server.errors import APIError
from inferd.server.file_store import FileStore
from inferd.server.options import ServerOptions
from inferd.server.reasoning import ReasoningSplit, reasoning_split
from inferd.server.responses_store import ResponseStore
from inferd.serving.interface import EmbeddingModel
from inferd.serving.loading import Servable
from inferd.serving.registry import (
    ConflictError,
    ModelRegistry,
    ModelSlot,
    ModelStatus,
    UnavailableError,
    UnknownModelError,
)
from inferd.serving.served import ServedModel

SEARCH_EMBED_CHARS = 2000  # of a text the search rerank embeds (its tokens are cut too)

# What each kind of model answers, and what a route wants, for the 400 a mismatch gets.
_SERVES = {
    "chat": "chat and completions (/v1/chat/completions, /v1/completions, /v1/messages)",
    "embedding": "/v1/embeddings",
}
_NEEDS = {
    "chat": "this route needs a chat model",
    "embedding": "/v1/embeddings needs an embedding model",
}


@dataclass(slots=True)
class ServerState:
    registry: ModelRegistry
    options: ServerOptions = field(default_factory=ServerOptions)
    started: float = 0.0
    # Stored responses (/v1/responses; opened on first use) and the background ones running.
    responses: ResponseStore = field(init=False)
    background_jobs: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    tools: Sequence[ToolSource] = ()  # the embedding program's own tool sources
    agent: AgentRuntime = field(init=False)  # the agent loop's tools and approvals
    sessions: SessionStore = field(init=False)  # agent sessions, beside the stored responses
    files: FileStore = field(init=False)  # /v1/files (files_api.py)

    def __post_init__(self) -> None:
        self.agent = AgentRuntime(self.options.agent, self.tools, self._search_embed)
        self.sessions = SessionStore(self.options.responses_store)
        self.responses = ResponseStore(self.options.responses_store, self.options.responses_ttl)
        self.responses.open_if_present()  # a dead server's unfinished responses: failed now
        self.files = FileStore(
            self.options.files_dir,
            max_file_bytes=self.options.max_file_bytes,
            max_total_bytes=self.options.max_files_total_bytes,
        )

    async def _search_embed(self, texts: Sequence[str]) -> list[list[float]]:
        """Vectors of ``texts`` from --search-embedding-model (each cut to what it takes)."""
        model = self.resolve_embedding_model(self.options.agent.search_embedding_model)
        ids = await asyncio.to_thread(model.tokenize, [t[:SEARCH_EMBED_CHARS] for t in texts])
        limit = model.max_model_len
        ids = [x if len(x) <= limit else [*x[: limit - 1], x[-1]] for x in ids]  # keep [SEP]
        return await model.embed_async(ids)

    @property
    def keepalive_seconds(self) -> float:
        return self.options.keepalive_seconds

    @property
    def max_logprobs_tokens(self) -> int:
        return self.options.max_logprobs_tokens

    @property
    def special_tokens_in_content(self) -> bool:
        return self.options.allow_special_tokens_in_content

    def reasoning(self, model: ServedModel, prompt: Sequence[int]) -> ReasoningSplit | None:
        """How this model's reply to this prompt splits into reasoning and answer, or None."""
        return reasoning_split(model, prompt, self.options.reasoning_parser)

    @property
    def models(self) -> dict[str, ServedModel]:
        """The loaded generative models by API id."""
        return {
            s.id: s.model
            for s in self.registry.slots.values()
            if s.status is ModelStatus.LOADED and isinstance(s.model, ServedModel)
        }

    @property
    def default_model(self) -> str | None:
        return self.registry.default_id

    def resolve_model(self, name: str | None) -> ServedModel:
        """The loaded chat model a request names (None or "default": the default model)."""
        model = self._resolve(name, "chat")
        assert isinstance(model, ServedModel)
        return model

    def resolve_embedding_model(self, name: str | None) -> EmbeddingModel:
        model = self._resolve(name, "embedding")
        assert isinstance(model, EmbeddingModel)
        return model

    def slot(self, name: str | None) -> ModelSlot:
        if not self.registry.slots:
            raise APIError(503, "no model is loaded")
        try:
            return self.registry.get(name)
        except UnknownModelError as exc:
            raise APIError(404, str(exc), param="model", code="model_not_found") from None

    def _resolve(self, name: str | None, kind: str) -> Servable:
        slot = self.slot(name)
        if slot.kind != kind:
            raise self.wrong_kind(slot, kind)
        model = slot.model
        if slot.status is not ModelStatus.LOADED or model is None:
            raise unavailable(UnavailableError(f"the model {slot.id!r} is {slot.status}"))
        return model

    def wrong_kind(self, slot: ModelSlot, wanted: str) -> APIError:
        others = [s.id for s in self.registry.slots.values() if s.kind == wanted]
        where = ", ".join(others) if others else "none on this server"
        return APIError(
            400,
            f"the model {slot.id!r} is {_article(slot.kind)} {slot.kind} model: it serves "
            f"{_SERVES[slot.kind]} only; {_NEEDS[wanted]} ({wanted} models here: {where})",
            param="model",
            code="model_kind_mismatch",
        )


def _article(kind: str) -> str:
    return "an" if kind[0] in "aeiou" else "a"


def unavailable(exc: UnavailableError) -> APIError:
    return APIError(
        503, str(exc), param="model", code="model_unavailable", headers={"Retry-After": "5"}
    )


def lifecycle_error(exc: Exception) -> APIError:
    """The HTTP error for a registry exception."""
    if isinstance(exc, UnknownModelError):
        return APIError(404, str(exc), param="model_id", code="model_not_found")
    if isinstance(exc, ConflictError):
        return APIError(409, str(exc), param="model_id", code="model_status_conflict")
    if isinstance(exc, UnavailableError):
        return unavailable(exc)
    raise exc
