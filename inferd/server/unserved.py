"""OpenAI routes for kinds of model inferd does not serve yet: image and speech generation.

A client that calls them gets OpenAI's error envelope with 501 and a message saying what
inferd serves instead, never a bare 404 that reads like a wrong URL or a missing prefix.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from inferd.server.errors import APIError

# route -> what it would make
UNSERVED = {
    "/v1/images/generations": "image generation",
    "/v1/images/edits": "image editing",
    "/v1/images/variations": "image variations",
    "/v1/audio/speech": "speech synthesis",
}


def not_served(what: str) -> Callable[[Request], Awaitable[Response]]:
    """The handler of a route for ``what``: 501, saying no model of that kind can be served."""

    async def handler(request: Request) -> Response:
        message = (
            f"{what} is not served by inferd: no model of that kind can be loaded yet; its "
            "models answer chat, completions, messages, responses and embeddings"
        )
        return APIError(501, message, code="model_kind_not_served").response()

    return handler
