"""The chat page: GET / serves a small static page (inferd/server/ui/, package data) that
talks to this server through its public API only (/v1/models, /v1/chat/completions).

The page and its two assets carry no secrets, so they are served without an API key (the page
asks for one and sends it as a Bearer token); every API call it makes is checked as any
other. Model output is put on the page as text, never as markup, and a strict Content Security
Policy keeps the page to its own script and style and to this server's API.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib.resources import files

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

# No inline script or style, no other origin; images only from the page's own data: or blob:
# URLs (an attached image's preview), audio and video only from data: URLs (an attached file,
# played back); fetches only to this server.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "media-src data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)


@dataclass(frozen=True, slots=True)
class Asset:
    file: str
    media_type: str


ASSETS = {
    "/": Asset("index.html", "text/html; charset=utf-8"),
    "/ui/app.js": Asset("app.js", "text/javascript; charset=utf-8"),
    "/ui/style.css": Asset("style.css", "text/css; charset=utf-8"),
}
PAGE_PATHS = frozenset(ASSETS)  # open without an API key (auth.py)


def install_chat_page(app: FastAPI) -> None:
    """Serve the page at / and its assets under /ui/, read once from the package."""
    folder = files("inferd.server") / "ui"
    for path, asset in ASSETS.items():
        body = (folder / asset.file).read_bytes()
        app.add_api_route(
            path, _handler(body, asset.media_type), methods=["GET"], include_in_schema=False
        )


def _handler(body: bytes, media_type: str) -> Callable[[Request], Awaitable[Response]]:
    headers = {
        "Content-Security-Policy": CSP,
        "X-Content-Type-Options": "nosniff",
        "X-Frame-Options": "DENY",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-cache",  # a new inferd's page is picked up at once
    }

    async def serve(request: Request) -> Response:
        return Response(body, media_type=media_type, headers=headers)

    return serve
