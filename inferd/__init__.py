"""inferd: a local LLM inference engine and OpenAI-compatible server on PyTorch."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from inferd.version import __version__

# On AMX CPUs oneDNN's bf16 matmul sums a row's products in an order that depends on how many
# rows the call holds, so a prompt's logits would depend on the requests batched beside it
# (tests/layers/test_linear.py). Its AVX-512 BF16 kernels give a row the same bits whatever the
# batch. oneDNN reads this once, at its first primitive; an operator's own setting wins.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

if TYPE_CHECKING:
    from inferd.api import ChatResult, Delta, EmbeddingResult, Engine, EngineError, ModelSpec
    from inferd.engine.sampling import SamplingParams
    from inferd.llm import LLM, CompletionOutput, RequestOutput
    from inferd.structured.constraint import Constraint

# The Python API, imported on first use so that `import inferd` (and the CLI) stays light.
_LAZY = {
    "ChatResult": "inferd.api",
    "CompletionOutput": "inferd.llm",
    "Constraint": "inferd.structured.constraint",
    "Delta": "inferd.api",
    "EmbeddingResult": "inferd.api",
    "Engine": "inferd.api",
    "EngineError": "inferd.api",
    "LLM": "inferd.llm",
    "ModelSpec": "inferd.api",
    "RequestOutput": "inferd.llm",
    "SamplingParams": "inferd.engine.sampling",
}
__all__ = [
    "LLM",
    "ChatResult",
    "CompletionOutput",
    "Constraint",
    "Delta",
    "EmbeddingResult",
    "Engine",
    "EngineError",
    "ModelSpec",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        import importlib

        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'inferd' has no attribute {name!r}")
