"""Server-sent events framing, and a keep-alive wrapper for slow first tokens."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, TypeVar

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"


def event(payload: dict[str, Any]) -> bytes:
    return (
        b"data: "
        + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
        + b"\n\n"
    )


def named_event(name: str, payload: dict[str, Any]) -> bytes:
    return f"event: {name}\n".encode() + event(payload)


def count_events(chunk: bytes) -> int:
    """How many events (not keep-alive comments) a body chunk of whole events holds: each has
    one ``data:`` line, as ours do (JSON payloads hold no newline)."""
    return chunk.count(b"\ndata:") + chunk.startswith(b"data:")


async def with_heartbeat(source: AsyncIterator[T], interval: float) -> AsyncIterator[T | None]:
    """Yield items from ``source``, and None whenever ``interval`` seconds pass without one.

    The pending ``__anext__`` is never cancelled by a heartbeat, so no item is lost.
    """
    pending: asyncio.Task[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(source.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield None
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield item
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
