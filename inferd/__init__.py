"""inferd: a local LLM inference engine and OpenAI-compatible server on PyTorch."""

from __future__ import annotations

__version__ = "0.1.0"
