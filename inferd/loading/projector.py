"""A llama.cpp multimodal projector file (``--mmproj FILE``) beside a GGUF language model: open
it, find its kind and check it against the language model before any weight is read.

A projector's ``general.architecture`` is ``clip``; its kind is ``clip.projector_type`` (older
files) or, per encoder, ``clip.vision.projector_type`` and ``clip.audio.projector_type``.
inferd runs three kinds: ``idefics3`` (SmolVLM, loading/mmproj.py), Gemma 4's ``gemma4v`` image
and ``gemma4a`` audio encoders (loading/mmproj_gemma4.py) and Qwen3-VL's ``qwen3vl_merger``
(loading/mmproj_qwen3vl.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from inferd.loading.gguf import GGUFFile
from inferd.loading.mmproj import IDEFICS3, Projector, ProjectorError, idefics3_projector
from inferd.loading.mmproj_gemma4 import GEMMA4_KINDS, Gemma4Projector, gemma4_projector
from inferd.loading.mmproj_qwen3vl import QWEN3VL, Qwen3VLProjector, qwen3vl_projector

CLIP_ARCHITECTURE = "clip"  # llama.cpp's general.architecture for a projector file
SUPPORTED = (
    f"{IDEFICS3}: SmolVLM / Idefics3; {' + '.join(GEMMA4_KINDS)}: Gemma 4; {QWEN3VL}: Qwen3-VL"
)

AnyProjector = Projector | Gemma4Projector | Qwen3VLProjector


def open_projector(path: str | Path, lm: Mapping[str, Any]) -> AnyProjector:
    """Open and check the projector at ``path`` against the language model's GGUF metadata
    ``lm``; ProjectorError (or GGUFError for a file that is no GGUF) says what does not fit."""
    gguf = GGUFFile(path)
    meta = gguf.metadata
    arch = meta.get("general.architecture")
    if arch != CLIP_ARCHITECTURE:
        raise ProjectorError(
            f"{gguf.path} is not a multimodal projector (general.architecture is {arch!r}, a "
            f"projector's is {CLIP_ARCHITECTURE!r})"
        )
    kinds = [
        meta.get(key)
        for key in ("clip.vision.projector_type", "clip.audio.projector_type")
        if meta.get(key) is not None
    ] or [meta.get("clip.projector_type")]
    if kinds == [IDEFICS3]:
        return idefics3_projector(gguf, lm)
    if kinds == [QWEN3VL]:
        return qwen3vl_projector(gguf, lm)
    if kinds and all(kind in GEMMA4_KINDS for kind in kinds):
        return gemma4_projector(gguf, lm)
    shown = " + ".join(repr(kind) for kind in kinds)
    raise ProjectorError(
        f"{gguf.path}: projector type {shown} is not supported (supported: {SUPPORTED})"
    )
