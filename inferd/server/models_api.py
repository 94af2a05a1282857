"""Model routes: listing, lifecycle (unload / reload / status), readiness, and the wrapper that
makes a request for an unloaded model wait for its (re)load.

    GET  /v1/models              "default" first when several models are served, then each
                                 model with its status, kind and modalities
    GET  /v1/models/{id}         one card (404 envelope when unknown)
    POST /v1/models/unload       {"model_id", "drain_timeout"?} -> drains, frees; 409 if not loaded
                                 (says how many requests finished meanwhile, how many aborted)
    POST /v1/models/reload       {"model_id"} -> loads again, waits; 409 if loaded or loading
    POST /v1/models/status       {"model_id"} -> {"model_id", "status", ...}
    GET  /ready                  200 when every configured model is loaded, else 503
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from inferd.server.envelope import error_response
from inferd.server.errors import APIError
from inferd.server.media import TEXT_ONLY, model_modalities
from inferd.server.protocol import load_json, parse_body
from inferd.server.state import ServerState, lifecycle_error
from inferd.serving.interface import EmbeddingModel
from inferd.serving.registry import (
    ConflictError,
    ModelSlot,
    ModelStatus,
    UnavailableError,
    UnknownModelError,
)
from inferd.serving.served import ServedModel

Handler = Callable[[Request], Awaitable[Response]]

EMBEDDING_MODALITIES = {"input": ["text"], "output": ["embedding"]}


class ModelOperation(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model_id: str = Field(min_length=1)


class UnloadOperation(ModelOperation):
    drain_timeout: float | None = Field(default=None, ge=0, le=3600)


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.inferd
    return state


# -- cards --------------------------------------------------------------------------------------
def model_card(slot: ModelSlot) -> dict[str, Any]:
    card: dict[str, Any] = {
        "id": slot.id,
        "object": "model",
        "created": slot.created,
        "owned_by": "inferd",
        "status": str(slot.status),
        "kind": slot.kind,
    }
    model = slot.model
    if isinstance(model, ServedModel):
        card["max_model_len"] = model.engine.max_model_len
        card["digest"] = f"sha256:{model.source.digest}"
        if model.source.revision is not None:  # a Hugging Face cache snapshot
            card["revision"] = model.source.revision
            card["files"] = {rel: f"sha256:{d}" for rel, d in model.source.file_digests}
        if model.isq is not None:
            card["quantization"] = model.isq
        if model.imatrix is not None:  # the importance matrix it was quantized for
            card["imatrix"] = f"sha256:{model.imatrix.digest()}"
        card["modalities"] = model_modalities(model).card()
        if model.parent is not None:  # a LoRA adapter on a base model
            card["parent"] = model.parent
    elif isinstance(model, EmbeddingModel):
        card["max_model_len"] = model.max_model_len
        card["dimensions"] = model.dimensions
        card["digest"] = f"sha256:{model.source.digest}"
        card["modalities"] = model_modalities(model).card()
    else:
        card["modalities"] = EMBEDDING_MODALITIES if slot.kind == "embedding" else TEXT_ONLY.card()
    if "parent" not in card and slot.parent is not None:  # an adapter not on an engine now
        card["parent"] = slot.parent.id
    if slot.label is not None:
        card["label"] = slot.label
    if slot.error is not None:
        card["error"] = slot.error
    return card


def default_card(slot: ModelSlot) -> dict[str, Any]:
    card = model_card(slot)
    card.pop("label", None)
    return card | {"id": "default", "alias_for": slot.id}


async def list_models(request: Request) -> Response:
    registry = _state(request).registry
    data = [model_card(s) for s in registry.slots.values()]
    default = registry.default_id
    if registry.multi and default is not None:
        data.insert(0, default_card(registry.slots[default]))
    return JSONResponse({"object": "list", "data": data})


async def retrieve_model(request: Request) -> Response:
    state = _state(request)
    name = request.path_params["model_id"]
    slot = state.slot(name)
    return JSONResponse(default_card(slot) if name == "default" else model_card(slot))


# -- lifecycle ----------------------------------------------------------------------------------
async def unload_model(request: Request) -> Response:
    state = _state(request)
    body = parse_body(await request.body(), UnloadOperation)
    slot = _slot(state, body.model_id)
    timeout = body.drain_timeout
    try:
        report = await slot.unload(state.registry.drain_timeout if timeout is None else timeout)
    except (ConflictError, UnavailableError) as exc:
        raise lifecycle_error(exc) from None
    return JSONResponse(_status(slot) | {"drained": report.drained, "aborted": report.aborted})


async def reload_model(request: Request) -> Response:
    state = _state(request)
    body = parse_body(await request.body(), ModelOperation)
    slot = _slot(state, body.model_id)
    try:
        await slot.reload()
    except ConflictError as exc:
        raise lifecycle_error(exc) from None
    except UnavailableError as exc:
        raise APIError(503, str(exc), param="model_id", code="model_load_failed") from None
    return JSONResponse(_status(slot))


async def model_status(request: Request) -> Response:
    state = _state(request)
    body = parse_body(await request.body(), ModelOperation)
    return JSONResponse(_status(_slot(state, body.model_id)))


async def ready(request: Request) -> Response:
    registry = _state(request).registry
    models = {s.id: str(s.status) for s in registry.slots.values()}
    if registry.all_loaded():
        return JSONResponse({"status": "ready", "models": models})
    return JSONResponse({"status": "not_ready", "models": models}, status_code=503)


def _slot(state: ServerState, model_id: str) -> ModelSlot:
    try:
        return state.registry.get(model_id)
    except UnknownModelError as exc:
        raise lifecycle_error(exc) from None


def _status(slot: ModelSlot) -> dict[str, Any]:
    out: dict[str, Any] = {"model_id": slot.id, "status": str(slot.status), "kind": slot.kind}
    if slot.error is not None:
        out["error"] = slot.error
    if slot.load_seconds is not None:
        out["load_seconds"] = round(slot.load_seconds, 3)
    return out


# -- waiting for a model ------------------------------------------------------------------------
def model_ready(handler: Handler, kind: str) -> Handler:
    """Wrap a route whose body names a model of ``kind``: when that model is loading, or
    unloaded with auto-reload on, wait for it first; unavailable -> 503 in the caller's
    envelope. The route itself resolves the model and answers every other error."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        registry = _state(request).registry
        if all(s.status is ModelStatus.LOADED for s in registry.slots.values()):
            return await handler(request)  # the common case costs one scan
        try:
            slot = registry.get(_model_field(await request.body()))
        except (UnknownModelError, ValueError, APIError):
            return await handler(request)  # the route's own 404 / 400
        if slot.kind == kind and slot.status is not ModelStatus.LOADED:
            try:
                await slot.ensure_loaded(registry.auto_reload)
            except UnavailableError as exc:
                err = lifecycle_error(exc)
                return error_response(
                    request.scope,
                    err.status,
                    err.message,
                    param="model",
                    code=err.code,
                    headers=err.headers,
                )
        return await handler(request)

    return wrapped


def _model_field(raw: bytes) -> str | None:
    data = load_json(raw)
    if not isinstance(data, dict):
        raise ValueError("not an object")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError("model is not a string")
    return model
