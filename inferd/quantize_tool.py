"""``inferd quantize``: quantize a model's projections once and keep them in the store, so that
a later ``--isq`` load reads the packed weights instead of quantizing again. ``inferd imatrix``:
a model's importance matrix from calibration text, in llama.cpp's file format, for
``inferd quantize --imatrix`` (and llama.cpp's ``llama-quantize --imatrix``)."""

from __future__ import annotations

from pathlib import Path

import torch

from inferd import kernels
from inferd.loading.calibration import compute_imatrix
from inferd.loading.gguf import GGUFFile
from inferd.loading.gguf_model import load_gguf_model
from inferd.loading.hf_model import load_safetensors_model
from inferd.loading.imatrix import Imatrix, ImatrixError
from inferd.loading.imatrix_file import write_imatrix
from inferd.loading.model import load
from inferd.loading.quantize import Isq, QuantizedManifest, save_quantized
from inferd.source import ModelSource


def quantize_to_store(
    source: ModelSource,
    method: str,
    *,
    imatrix: Imatrix | None = None,
    home: Path | None = None,
    progress: bool = True,
) -> tuple[Path, QuantizedManifest, Isq]:
    """Quantize ``source``'s projections (for ``imatrix``'s importance, if given) and keep them
    in the store; returns the entry and the request that made it (``weighted``: the projections
    the matrix covered)."""
    isq = Isq(method, collect=True, imatrix=imatrix)
    dtype = torch.bfloat16  # only the quantized weights are kept; they come from float32
    if source.path.is_dir():
        _, cfg = load_safetensors_model(
            source.path, dtype, progress=progress, packed_kernels=False, isq=isq
        )
    else:
        _, cfg = load_gguf_model(
            GGUFFile(source.path), dtype, progress=progress, packed_kernels=False, isq=isq
        )
    if imatrix is not None and not isq.weighted:
        raise ImatrixError(
            f"the importance matrix has no entry for any projection of {source.name} "
            "(made for another model?)"
        )
    folder, manifest = save_quantized(
        isq.quantized,
        source_name=source.name,
        source_digest=source.digest,
        method=method,
        architecture=cfg.architecture,
        home=home,
        imatrix=imatrix.digest() if imatrix is not None else None,
    )
    return folder, manifest, isq


def imatrix_to_file(
    source: ModelSource,
    calibration: Path,
    output: Path,
    *,
    chunk_size: int,
    max_chunks: int | None = None,
    dtype: str = "f32",
    progress: bool = True,
) -> Imatrix:
    """Run ``calibration`` (a text file) through ``source`` and write its importance matrix to
    ``output`` (llama.cpp's GGUF format; its legacy one for a ``.dat`` name)."""
    text = calibration.read_text(encoding="utf-8")
    loaded = load(source, dtype=dtype, packed_kernels=False, progress=progress)
    loaded.model.use_kernels(kernels.load_ops(loaded.dtype))
    imatrix = compute_imatrix(
        loaded.model,
        loaded.tokenizer,
        text,
        chunk_size=chunk_size,
        max_chunks=max_chunks,
        dataset=str(calibration),
        progress=progress,
    )
    write_imatrix(
        imatrix, output, loaded.config.architecture, legacy=output.suffix.lower() == ".dat"
    )
    return imatrix
