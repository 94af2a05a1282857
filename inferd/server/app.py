"""build_app: the ASGI application that serves one or more loaded models."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from inferd.server.anthropic_api import count_tokens, create_message
from inferd.server.defaults import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_HEADER_BYTES
from inferd.server.envelope import error_response
from inferd.server.errors import APIError
from inferd.server.hooks import OnChunk, OnDone, StreamHooks, StreamHooksMiddleware
from inferd.server.media import MediaPolicy
from inferd.server.middleware import RequestIdMiddleware
from inferd.server.models_api import (
    list_models,
    model_ready,
    model_status,
    ready,
    reload_model,
    retrieve_model,
    unload_model,
)
from inferd.server.openai_chat import create_chat_completion
from inferd.server.openai_completions import create_completion
from inferd.server.openai_embeddings import create_embedding
from inferd.server.operations import docs_urls, install_operations, operations
from inferd.server.state import ServerState
from inferd.server.system_info import system_info
from inferd.server.tokenize import detokenize, tokenize
from inferd.serving.registry import DEFAULT_DRAIN_TIMEOUT, registry_of
from inferd.version import __version__

if TYPE_CHECKING:
    from inferd.api import Engine
    from inferd.engine.embedding import EmbeddingModel
    from inferd.serving.registry import ModelRegistry, ModelSlot
    from inferd.serving.served import ServedModel

Handler = Callable[[Request], Awaitable[Response]]


def build_app(
    models: Sequence[ServedModel | EmbeddingModel | Engine | ModelSlot] | ModelRegistry = (),
    *,
    default_model: str | None = None,
    auto_reload: bool = True,
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
    on_chunk: OnChunk | None = None,
    on_done: OnDone | None = None,
    keepalive_seconds: float = 5.0,
    api_keys: Sequence[str] = (),
    max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES,
    max_header_bytes: int | None = DEFAULT_MAX_HEADER_BYTES,
    request_timeout: float | None = None,
    allowed_origins: Sequence[str] = (),
    access_log_format: str | None = "text",
    log_payloads: str | Path | None = None,
    metrics: bool = True,
    docs: bool = True,
    media_policy: MediaPolicy | None = None,
) -> FastAPI:
    """The server app, an ASGI app that may be mounted under any path of another app.

    ``models``: loaded models (ServedModel, EmbeddingModel), ``inferd.Engine``s, or a
    ModelRegistry (see ``registry_of``); ``default_model`` answers "default" or no model (else
    the first to load). A request for an unloaded model reloads it when ``auto_reload``, else
    gets 503; unloading drains for up to ``drain_timeout`` seconds. ``on_chunk`` / ``on_done``
    are stream hooks (see hooks.py). Operational options (see operations.py) default to the
    safe choice: no auth keys means open (bind to loopback), 16 MiB bodies, 16 KiB heads, no
    CORS, no payload logging, no file or remote media."""
    ops = operations(
        api_keys=api_keys,
        max_body_bytes=max_body_bytes,
        max_header_bytes=max_header_bytes,
        request_timeout=request_timeout,
        allowed_origins=allowed_origins,
        access_log_format=access_log_format,
        log_payloads=log_payloads,
        metrics=metrics,
        docs=docs,
        media_policy=media_policy,
    )
    app = FastAPI(title="inferd", version=__version__, **docs_urls(docs))
    registry = registry_of(
        models, default_id=default_model, auto_reload=auto_reload, drain_timeout=drain_timeout
    )
    app.state.inferd = ServerState(
        registry=registry,
        keepalive_seconds=keepalive_seconds,
        started=time.time(),
    )
    _routes(app, "/v1/chat/completions", model_ready(create_chat_completion, "chat"), ["POST"])
    _routes(app, "/v1/models", list_models, ["GET"])
    _routes(app, "/v1/models/{model_id:path}", retrieve_model, ["GET"])
    _routes(app, "/v1/models/unload", unload_model, ["POST"])
    _routes(app, "/v1/models/reload", reload_model, ["POST"])
    _routes(app, "/v1/models/status", model_status, ["POST"])
    _routes(app, "/v1/completions", model_ready(create_completion, "chat"), ["POST"])
    _routes(app, "/v1/embeddings", model_ready(create_embedding, "embedding"), ["POST"])
    _routes(app, "/v1/messages", model_ready(create_message, "chat"), ["POST"])
    _routes(app, "/v1/messages/count_tokens", model_ready(count_tokens, "chat"), ["POST"])
    _routes(app, "/v1/tokenize", model_ready(tokenize, "chat"), ["POST"])
    _routes(app, "/v1/detokenize", model_ready(detokenize, "chat"), ["POST"])
    _routes(app, "/v1/system/info", system_info, ["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/ready", ready, methods=["GET"])
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    hooks = StreamHooks(on_chunk, on_done)
    if hooks:
        app.add_middleware(StreamHooksMiddleware, hooks=hooks)  # innermost: sees route bytes
    install_operations(app, ops)
    app.add_middleware(RequestIdMiddleware)
    return app


def _routes(app: FastAPI, path: str, handler: Handler, methods: list[str]) -> None:
    """Serve each route at /v1/... and without the prefix, as OpenAI clients vary."""
    app.add_api_route(path, handler, methods=methods)
    app.add_api_route(path.removeprefix("/v1"), handler, methods=methods, include_in_schema=False)


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    # OpenAI's envelope, or Anthropic's for requests that carry `anthropic-version`
    headers = dict(exc.headers or {})
    return error_response(request.scope, exc.status_code, message, headers=headers)


async def _validation_error(request: Request, exc: Exception) -> Response:
    return APIError(400, f"invalid request: {exc}").response()
