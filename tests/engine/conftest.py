"""Engines the speculative-decoding tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from inferd import LLM


@pytest.fixture(scope="module")
def pair(smollm2_gguf: Path) -> Iterator[tuple[LLM, LLM]]:
    """The default model twice, in the default mode: speculation on, and off."""
    with (
        LLM(str(smollm2_gguf), speculative="ngram") as on,
        LLM(str(smollm2_gguf), speculative="off") as off,
    ):
        yield on, off
