"""inferd: a local LLM inference engine and OpenAI-compatible server on PyTorch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from inferd.version import __version__

if TYPE_CHECKING:
    from inferd.api import ChatResult, Delta, EmbeddingResult, Engine, EngineError, ModelSpec

# The Python API, imported on first use so that `import inferd` (and the CLI) stays light.
__all__ = [
    "ChatResult",
    "Delta",
    "EmbeddingResult",
    "Engine",
    "EngineError",
    "ModelSpec",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from inferd import api

        return getattr(api, name)
    raise AttributeError(f"module 'inferd' has no attribute {name!r}")
