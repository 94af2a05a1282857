"""``inferd quantize``: quantize a model's projections once and keep them in the store, so that
a later ``--isq`` load reads the packed weights instead of quantizing again."""

from __future__ import annotations

from pathlib import Path

import torch

from inferd.loading.gguf import GGUFFile
from inferd.loading.gguf_model import load_gguf_model
from inferd.loading.hf_model import load_safetensors_model
from inferd.loading.quantize import Isq, QuantizedManifest, save_quantized
from inferd.source import ModelSource


def quantize_to_store(
    source: ModelSource, method: str, *, home: Path | None = None, progress: bool = True
) -> tuple[Path, QuantizedManifest]:
    """Quantize ``source``'s projections and keep them in the store; returns the entry."""
    isq = Isq(method, collect=True)
    dtype = torch.bfloat16  # only the quantized weights are kept; they come from float32
    if source.path.is_dir():
        _, cfg = load_safetensors_model(
            source.path, dtype, progress=progress, packed_kernels=False, isq=isq
        )
    else:
        _, cfg = load_gguf_model(
            GGUFFile(source.path), dtype, progress=progress, packed_kernels=False, isq=isq
        )
    return save_quantized(
        isq.quantized,
        source_name=source.name,
        source_digest=source.digest,
        method=method,
        architecture=cfg.architecture,
        home=home,
    )
