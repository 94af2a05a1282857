"""The HTTP server: ``build_app(models_or_engines, ServerOptions(...))`` returns a mountable
ASGI app."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inferd.server.app import build_app
    from inferd.server.hooks import StreamInfo, StreamSummary
    from inferd.server.options import ServerOptions

__all__ = ["ServerOptions", "StreamInfo", "StreamSummary", "build_app"]
_EXPORTS = {
    "build_app": "inferd.server.app",
    "ServerOptions": "inferd.server.options",
    "StreamInfo": "inferd.server.hooks",
    "StreamSummary": "inferd.server.hooks",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'inferd.server' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
