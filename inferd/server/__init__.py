"""The HTTP server: ``build_app(models_or_engines, **options)`` returns a mountable ASGI app."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inferd.server.app import build_app
    from inferd.server.hooks import StreamInfo, StreamSummary

__all__ = ["StreamInfo", "StreamSummary", "build_app"]
_EXPORTS = {
    "build_app": "inferd.server.app",
    "StreamInfo": "inferd.server.hooks",
    "StreamSummary": "inferd.server.hooks",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'inferd.server' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
