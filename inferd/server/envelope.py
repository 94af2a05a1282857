"""Errors raised by middleware, in the caller's envelope.

Middleware answers before any route runs, so it decides the envelope from the request alone:
Anthropic's ``{"type": "error", "error": {"type", "message"}, "request_id"}`` when the request
carries an
``anthropic-version`` header or targets ``/v1/messages``; OpenAI's
``{"error": {"message", "type", "param", "code"}}`` otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import Scope

from inferd.server.errors import APIError, clip_message

ANTHROPIC_PATHS = ("/v1/messages", "/messages")
RESPONSES_PATHS = ("/v1/responses", "/responses")

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    431: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def header(scope: Mapping[str, Any], name: bytes) -> str | None:
    """The first value of header ``name`` (lower-case bytes), or None."""
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


def app_path(scope: Mapping[str, Any]) -> str:
    """The request path inside this app: without the prefix it is mounted under, if any."""
    root = str(scope.get("root_path", ""))
    path = str(scope.get("path", ""))
    return path.removeprefix(root) if root and path.startswith(root) else path


def wants_anthropic(scope: Scope) -> bool:
    if header(scope, b"anthropic-version") is not None:
        return True
    path = app_path(scope)
    return any(path == p or path.startswith(p + "/") for p in ANTHROPIC_PATHS)


def wants_responses(scope: Scope) -> bool:
    """A POST to create a Responses response, whose stream has typed events."""
    return scope.get("method") == "POST" and app_path(scope) in RESPONSES_PATHS


def error_body(
    scope: Scope, status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    if wants_anthropic(scope):
        kind = _ANTHROPIC_TYPES.get(
            status, "api_error" if status >= 500 else "invalid_request_error"
        )
        # Anthropic's errors carry the request's id (ours: the x-request-id header's value).
        request_id = (scope.get("state") or {}).get("request_id")
        return {
            "type": "error",
            "error": {"type": kind, "message": clip_message(message)},
            "request_id": request_id,
        }
    return APIError(status, message, param=param, code=code).body()


def error_response(
    scope: Scope,
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = error_body(scope, status, message, param=param, code=code)
    return JSONResponse(body, status_code=status, headers=headers)


def stream_error_event(
    scope: Scope,
    message: str,
    code: str,
    status: int = 504,
    events_sent: int = 0,
    usage: dict[str, Any] | None = None,
) -> bytes:
    """The last SSE event of a stream that fails after its headers went out.

    OpenAI-style streams get ``data: {"error": ...}`` (with ``usage`` beside it when given:
    the caller asked for usage) then ``data: [DONE]``; Anthropic streams get ``event: error``;
    Responses streams (POST /v1/responses) their typed ``error`` event, numbered after the
    ``events_sent`` events before it (they have no [DONE] either).
    """
    if wants_responses(scope):
        payload = {
            "type": "error",
            "code": code,
            "message": clip_message(message),
            "param": None,
            "sequence_number": events_sent,
        }
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        return f"event: error\ndata: {data}\n\n".encode()
    body = error_body(scope, status, message, code=code)
    if usage is not None and not wants_anthropic(scope):
        body["usage"] = usage
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    if wants_anthropic(scope):
        return f"event: error\ndata: {data}\n\n".encode()
    return f"data: {data}\n\n".encode() + b"data: [DONE]\n\n"
