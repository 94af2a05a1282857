"""build_app: the ASGI application that serves one or more loaded models."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from inferd import __version__
from inferd.engine.builder import ServedModel
from inferd.server.errors import APIError
from inferd.server.metrics import metrics
from inferd.server.middleware import RequestIdMiddleware
from inferd.server.openai_chat import create_chat_completion
from inferd.server.state import ServerState

Handler = Callable[[Request], Awaitable[Response]]


def build_app(
    models: list[ServedModel], *, default_model: str | None = None, keepalive_seconds: float = 5.0
) -> FastAPI:
    app = FastAPI(title="inferd", version=__version__)
    app.state.inferd = ServerState(
        models={m.id: m for m in models},
        default_model=default_model,
        keepalive_seconds=keepalive_seconds,
        started=time.time(),
    )
    _routes(app, "/v1/chat/completions", create_chat_completion, ["POST"])
    _routes(app, "/v1/models", list_models, ["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_middleware(RequestIdMiddleware)
    return app


def _routes(app: FastAPI, path: str, handler: Handler, methods: list[str]) -> None:
    """Serve each route at /v1/... and without the prefix, as OpenAI clients vary."""
    app.add_api_route(path, handler, methods=methods)
    app.add_api_route(path.removeprefix("/v1"), handler, methods=methods, include_in_schema=False)


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def list_models(request: Request) -> Response:
    state: ServerState = request.app.state.inferd
    return JSONResponse({"object": "list", "data": [_model_card(m) for m in state.models.values()]})


def _model_card(model: ServedModel) -> dict[str, Any]:
    return {
        "id": model.id,
        "object": "model",
        "created": model.created,
        "owned_by": "inferd",
        "status": "loaded",
        "max_model_len": model.engine.max_model_len,
        "digest": f"sha256:{model.source.digest}",
    }


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
    return APIError(exc.status_code, message, headers=dict(exc.headers or {})).response()


async def _validation_error(request: Request, exc: Exception) -> Response:
    return APIError(400, f"invalid request: {exc}").response()
