"""build_app: the ASGI application that serves one or more loaded models."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from inferd.agent.tools import ToolSource
from inferd.server.agent_sessions import delete_session, get_session, list_sessions
from inferd.server.anthropic_api import count_tokens, create_message
from inferd.server.approvals import answer_approval, list_approvals
from inferd.server.calibration_api import (
    calibration_apply,
    calibration_imatrix,
    calibration_start,
    calibration_status,
)
from inferd.server.chat_page import install_chat_page
from inferd.server.crosssite import json_only
from inferd.server.envelope import error_response
from inferd.server.errors import APIError
from inferd.server.files_api import (
    create_file,
    delete_file,
    file_content,
    list_files,
    retrieve_file,
)
from inferd.server.hooks import OnChunk, OnDone, StreamHooks, StreamHooksMiddleware
from inferd.server.lora_api import load_lora_adapter, unload_lora_adapter
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
from inferd.server.operations import docs_urls, install_operations
from inferd.server.options import ServerOptions
from inferd.server.requantize_api import re_isq
from inferd.server.responses_api import (
    cancel_response,
    create_response,
    delete_response,
    list_input_items,
    retrieve_response,
)
from inferd.server.responses_store import StoreError
from inferd.server.skills_api import create_skill, delete_skill, get_skill, list_skills
from inferd.server.state import ServerState
from inferd.server.system_info import system_info, system_tune
from inferd.server.tokenize import detokenize, tokenize
from inferd.server.unserved import UNSERVED, not_served
from inferd.serving.registry import registry_of
from inferd.version import __version__

if TYPE_CHECKING:
    from inferd.api import Engine
    from inferd.server.mcp_server import McpRoute
    from inferd.serving.interface import EmbeddingModel
    from inferd.serving.registry import ModelRegistry, ModelSlot
    from inferd.serving.served import ServedModel

Handler = Callable[[Request], Awaitable[Response]]


def build_app(
    models: Sequence[ServedModel | EmbeddingModel | Engine | ModelSlot] | ModelRegistry = (),
    options: ServerOptions | None = None,
    *,
    on_chunk: OnChunk | None = None,
    on_done: OnDone | None = None,
    tools: Sequence[ToolSource] = (),
) -> FastAPI:
    """The server app, an ASGI app that may be mounted under any path of another app.

    ``models``: loaded models (ServedModel, EmbeddingModel), ``inferd.Engine``s, or a
    ModelRegistry (see ``registry_of``). ``options``: every setting (see options.py; the
    defaults are the safe choice). ``on_chunk`` / ``on_done`` are stream hooks (see hooks.py):
    code of the embedding app, not settings. The Host check (421) is off unless
    ``options.allowed_hosts`` is given, as the names an embedding app is reached under are its
    own; `inferd serve` always sets it. ``app.state.drain`` drains running requests for a
    graceful stop (shutdown.py). ``tools``: tool sources of the embedding program (such as
    ``inferd.agent.FunctionTools``) the agent loop runs beside the configured ones."""
    options = options or ServerOptions()
    mcp: McpRoute | None = None  # the /mcp route, with options.mcp_route

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with mcp.running() if mcp is not None else contextlib.nullcontext():
            yield
        await app.state.inferd.agent.close()  # MCP sessions and their processes
        app.state.inferd.files.close()  # a temporary folder goes with the app

    app = FastAPI(
        title="inferd",
        version=__version__,
        lifespan=lifespan,
        **docs_urls(options.docs, options.docs_base_path),
    )
    registry = registry_of(
        models,
        default_id=options.default_model,
        auto_reload=options.auto_reload,
        drain_timeout=options.drain_timeout,
    )
    app.state.inferd = ServerState(
        registry=registry, options=options, started=time.time(), tools=tools
    )
    _routes(app, "/v1/chat/completions", model_ready(create_chat_completion, "chat"), ["POST"])
    _routes(app, "/v1/models", list_models, ["GET"])
    _routes(app, "/v1/models/{model_id:path}", retrieve_model, ["GET"])
    _routes(app, "/v1/models/unload", unload_model, ["POST"])
    _routes(app, "/v1/models/reload", reload_model, ["POST"])
    _routes(app, "/v1/models/status", model_status, ["POST"])
    _routes(app, "/v1/re_isq", re_isq, ["POST"])  # mistral.rs's /re_isq
    _routes(app, "/v1/calibration/start", calibration_start, ["POST"])  # mistral.rs's too
    _routes(app, "/v1/calibration/status", calibration_status, ["GET"])
    _routes(app, "/v1/calibration/apply", calibration_apply, ["POST"])
    _routes(app, "/v1/calibration/imatrix", calibration_imatrix, ["GET"])
    _routes(app, "/v1/load_lora_adapter", load_lora_adapter, ["POST"])
    _routes(app, "/v1/unload_lora_adapter", unload_lora_adapter, ["POST"])
    _routes(app, "/v1/completions", model_ready(create_completion, "chat"), ["POST"])
    _routes(app, "/v1/embeddings", model_ready(create_embedding, "embedding"), ["POST"])
    _routes(app, "/v1/messages", model_ready(create_message, "chat"), ["POST"])
    _routes(app, "/v1/messages/count_tokens", model_ready(count_tokens, "chat"), ["POST"])
    _routes(app, "/v1/responses", model_ready(create_response, "chat"), ["POST"])
    _routes(app, "/v1/responses/{response_id}", retrieve_response, ["GET"])
    _routes(app, "/v1/responses/{response_id}", delete_response, ["DELETE"])
    _routes(app, "/v1/responses/{response_id}/input_items", list_input_items, ["GET"])
    # cancel takes no body, so no JSON content type either
    _routes(app, "/v1/responses/{response_id}/cancel", cancel_response, ["POST"], json=False)
    _routes(app, "/v1/tokenize", model_ready(tokenize, "chat"), ["POST"])
    _routes(app, "/v1/detokenize", model_ready(detokenize, "chat"), ["POST"])
    _routes(app, "/v1/system/info", system_info, ["GET"])
    _routes(app, "/v1/system/tune", system_tune, ["GET"])
    _routes(app, "/v1/agent/approvals", list_approvals, ["GET"])
    _routes(app, "/v1/agent/approvals/{approval_id}", answer_approval, ["POST"])
    _routes(app, "/v1/agent/sessions", list_sessions, ["GET"])
    _routes(app, "/v1/agent/sessions/{session_id}", get_session, ["GET"])
    _routes(app, "/v1/agent/sessions/{session_id}", delete_session, ["DELETE"])
    _routes(app, "/v1/files", list_files, ["GET"])
    _routes(app, "/v1/files", create_file, ["POST"], json=False)  # multipart
    _routes(app, "/v1/files/{file_id}", retrieve_file, ["GET"])
    _routes(app, "/v1/files/{file_id}", delete_file, ["DELETE"])
    _routes(app, "/v1/files/{file_id}/content", file_content, ["GET"])
    _routes(app, "/v1/skills", list_skills, ["GET"])
    _routes(app, "/v1/skills", create_skill, ["POST"], json=False)  # multipart
    _routes(app, "/v1/skills/{skill_id}", get_skill, ["GET"])
    _routes(app, "/v1/skills/{skill_id}", delete_skill, ["DELETE"])
    for path, what in UNSERVED.items():
        _routes(app, path, not_served(what), ["POST"], json=False)  # multipart or JSON alike
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/ready", ready, methods=["GET"])
    if options.ui:
        install_chat_page(app)
    if options.mcp_route:
        from inferd.server.mcp_server import mount_mcp  # the MCP SDK, only when asked for

        mcp = mount_mcp(app, options.allowed_origins)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StoreError, _store_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    hooks = StreamHooks(on_chunk, on_done)
    if hooks:
        app.add_middleware(StreamHooksMiddleware, hooks=hooks)  # innermost: sees route bytes
    install_operations(app, options)
    app.add_middleware(RequestIdMiddleware)
    return app


def _routes(
    app: FastAPI, path: str, handler: Handler, methods: list[str], *, json: bool = True
) -> None:
    """Serve each route at /v1/... and without the prefix, as OpenAI clients vary. POST routes
    take JSON bodies, and only with a JSON content type (see crosssite.py)."""
    if "POST" in methods and json:
        handler = json_only(handler)
    app.add_api_route(path, handler, methods=methods)
    app.add_api_route(path.removeprefix("/v1"), handler, methods=methods, include_in_schema=False)


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _store_error(request: Request, exc: Exception) -> Response:
    """The responses store cannot be opened (a foreign file, a newer schema): the operator's
    to fix, so 503 saying what is wrong with it."""
    return APIError(503, str(exc), code="responses_store_unavailable").response()


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
