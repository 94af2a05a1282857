"""The OpenAPI document at /openapi.json and /api-doc/openapi.json (no /docs page renders
it: operations.docs_urls).

Handlers parse their own bodies (so every error names the parameter), which leaves FastAPI
without request schemas; this fills them in from the pydantic request models, and describes
API-key auth when the server requires it. Models are looked up by name so routes added later
appear as soon as their model exists.
"""

from __future__ import annotations

import importlib
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse

# POST path -> (module, request model class)
REQUEST_MODELS = {
    "/v1/chat/completions": ("inferd.server.protocol", "ChatCompletionRequest"),
    "/v1/completions": ("inferd.server.protocol", "CompletionRequest"),
    "/v1/embeddings": ("inferd.server.openai_embeddings", "EmbeddingRequest"),
    "/v1/messages": ("inferd.server.anthropic_protocol", "MessagesRequest"),
    "/v1/messages/count_tokens": ("inferd.server.anthropic_protocol", "CountTokensRequest"),
    "/v1/tokenize": ("inferd.server.tokenize", "TokenizeRequest"),
    "/v1/detokenize": ("inferd.server.tokenize", "DetokenizeRequest"),
    "/v1/re_isq": ("inferd.server.requantize_api", "ReIsqRequest"),
    "/v1/calibration/start": ("inferd.server.calibration_api", "CalibrationStartRequest"),
    "/v1/calibration/apply": ("inferd.server.calibration_api", "CalibrationApplyRequest"),
}
OPEN_PATHS = ("/health",)


def install_openapi(app: FastAPI, *, auth_required: bool, base_path: str = "") -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_document(app, auth_required=auth_required)
        return app.openapi_schema

    async def api_doc(_: Request) -> JSONResponse:
        return JSONResponse(openapi())

    app.openapi = openapi  # type: ignore[method-assign]
    # The same document where mistral.rs serves it (its /docs page is not served here).
    app.add_route(f"{base_path}/api-doc/openapi.json", api_doc, ["GET"], include_in_schema=False)


def build_document(app: FastAPI, *, auth_required: bool) -> dict[str, Any]:
    doc = get_openapi(
        title=app.title,
        version=app.version,
        description="OpenAI- and Anthropic-compatible local inference.",
        routes=app.routes,
    )
    schemas: dict[str, Any] = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, operations in doc.get("paths", {}).items():
        post = operations.get("post")
        model = _request_model(path)
        if post is None or model is None:
            continue
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        post["requestBody"] = {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
            },
        }
    if auth_required:
        doc["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
        }
        doc["security"] = [{"bearer": []}, {"apiKey": []}]
        for path in OPEN_PATHS:
            for operation in doc.get("paths", {}).get(path, {}).values():
                operation["security"] = []
    return doc


def _request_model(path: str) -> type[BaseModel] | None:
    entry = REQUEST_MODELS.get(path)
    if entry is None:
        return None
    try:
        module = importlib.import_module(entry[0])
    except ImportError:
        return None
    model = getattr(module, entry[1], None)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None
