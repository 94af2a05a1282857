"""ASGI middleware: request ids (echoed when valid, generated otherwise), and the last line of
defence: an exception no handler caught becomes a 500 in the caller's envelope, with the id."""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Mapping
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferd.server.envelope import error_response
from inferd.server.errors import bad_request

log = logging.getLogger("inferd")

REQUEST_ID_HEADER = "x-request-id"
_VALID_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


class RequestIdMiddleware:
    """Every response carries ``x-request-id``; a caller's id is kept only if well formed.

    Outermost of the app's own middleware, so it also turns any exception that escapes the
    layers inside it into a 500 envelope (Starlette's fallback would be plain text, no id).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = _header(scope, REQUEST_ID_HEADER.encode())
        if sent is not None and not _VALID_ID.match(sent):
            request_id = uuid.uuid4().hex
            err = bad_request(
                "x-request-id must be 1-128 characters of letters, digits, '.', '_', ':' or '-'",
                param=REQUEST_ID_HEADER,
            )
            err.headers = {REQUEST_ID_HEADER: request_id}
            await err.response()(scope, receive, send)
            return
        request_id = sent or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [
                    (k, v) for k, v in message.get("headers", []) if k != REQUEST_ID_HEADER.encode()
                ]
                headers.append((REQUEST_ID_HEADER.encode(), request_id.encode()))
                message["headers"] = headers
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            if started:  # too late for a status; the server closes the connection
                raise
            log.exception("request %s failed", request_id)
            message = (
                "the server failed while handling this request; "
                f"its log has the details under request id {request_id}"
            )
            response = error_response(scope, 500, message, code="internal_error")
            await response(scope, receive, send_with_id)


def _header(scope: Mapping[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None
