"""Closing an engine stream, which aborts its request (and frees its KV blocks) if unfinished."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any


async def close_stream(outputs: AsyncIterator[Any]) -> None:
    """Close an async generator (aclose) or an engine ``RequestStream`` (close)."""
    aclose = getattr(outputs, "aclose", None)
    if aclose is not None:
        await aclose()
        return
    close = getattr(outputs, "close", None)
    if close is not None:
        close()
