"""API errors in OpenAI's envelope: {"error": {"message", "type", "param", "code"}}.

Messages often quote what the caller sent (a model name, a role, a URL); ``clip_message``
bounds every message here, once, so a 1 MB value is never echoed back whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse

MAX_MESSAGE_CHARS = 300  # longer messages keep their head and tail, so quote < ~200 of a value
_HEAD_CHARS = 160
_TAIL_CHARS = 80

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


@dataclass(slots=True)
class APIError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None

    def __post_init__(self) -> None:
        self.message = clip_message(self.message)

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def clip_message(message: str) -> str:
    """``message``, or its head and tail around a note of how much was left out.

    The head keeps what the message is about and the tail how it ends (often the hint of what
    to send instead); a value quoted in between loses its middle.
    """
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    cut = len(message) - _HEAD_CHARS - _TAIL_CHARS
    return f"{message[:_HEAD_CHARS]}[... {cut} characters ...]{message[-_TAIL_CHARS:]}"
