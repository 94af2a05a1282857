"""One HTTP request carried as plain data and run through an inferd ASGI app in process, its
response coming back as plain data too: the head first (``ResponseHead``), then the body's
chunks as they are sent (a stream's SSE events one by one).

The Ray replicas replay what the ingress read (a Serve handle call carries picklable values,
not an ASGI connection, so the ingress reads the body once: it needs it for routing anyway),
and the MCP tools (mcp_server.py) send their calls to the server's own API this way.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[
    [Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
    Awaitable[None],
]


@dataclass(frozen=True, slots=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    client: tuple[str, int] | None = None

    def scope(self) -> Scope:
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": self.method,
            "scheme": "http",
            "path": self.path,
            "raw_path": self.path.encode(),
            "root_path": "",
            "query_string": self.query_string,
            "headers": list(self.headers),
            "client": self.client,
            "server": ("127.0.0.1", 0),
            "state": {},
        }


@dataclass(frozen=True, slots=True)
class ResponseHead:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k.lower() == name), None)


async def run_request(
    app: ASGIApp, request: ForwardedRequest, extra_headers: tuple[tuple[bytes, bytes], ...] = ()
) -> AsyncIterator[ResponseHead | bytes]:
    """Run ``request`` through ``app``: its head (plus ``extra_headers``), then its body chunks.
    Closing the iterator early (the caller went away) tells the app the client disconnected, so
    its generation is aborted as on a dropped connection."""
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)

    async def run() -> None:
        try:
            await app(request.scope(), receive, send)
        finally:
            await sent.put(None)

    task = asyncio.create_task(run())
    try:
        while True:
            message = await sent.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                headers = tuple((bytes(k), bytes(v)) for k, v in message.get("headers", ()))
                yield ResponseHead(int(message["status"]), headers + extra_headers)
            elif message["type"] == "http.response.body":
                chunk = bytes(message.get("body", b""))
                if chunk:
                    yield chunk
                if not message.get("more_body", False):
                    break
        await task  # the app's own errors surface here
    finally:
        disconnected.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, Exception):
                await asyncio.wait_for(task, timeout=5)
            task.cancel()
