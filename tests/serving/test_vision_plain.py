"""The ``VisionPlain`` model kind of a models file (mistral.rs's name for a Hugging Face
directory of a model that reads media): it loads a multimodal directory as ``Plain`` does, and
refuses a text-only one with a message that says to use ``Plain``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from inferd.config import EngineConfig
from inferd.engine.driver import CallerLoop
from inferd.serving.loading import ModelLoadError, expected_kind, load_spec
from inferd.serving.served import ServedModel
from inferd.serving.spec import load_models_file
from tests.models.tiny import save_tiny

ENGINE = EngineConfig(dtype="f32", kv_cache_tokens=1024, max_model_len=128)


def _spec(tmp_path: Path, directory: Path) -> Any:
    config = tmp_path / "models.json"
    config.write_text(json.dumps({"seeing": {"VisionPlain": {"model_id": str(directory)}}}))
    (spec,) = load_models_file(config)
    return spec


def test_a_multimodal_directory_loads_as_vision_plain(tiny_gemma4: Any, tmp_path: Path) -> None:
    spec = _spec(tmp_path, tiny_gemma4[0])
    assert spec.kind == "VisionPlain" and expected_kind(spec) == "chat"
    model = load_spec(spec, ENGINE, loop=CallerLoop())
    try:
        assert isinstance(model, ServedModel)
        assert model.prompter.modalities == ("text", "image", "video", "audio")
    finally:
        model.shutdown()


def test_a_text_only_directory_is_refused_as_vision_plain(tmp_path: Path) -> None:
    directory = tmp_path / "llama"
    save_tiny("llama", directory)
    with pytest.raises(ModelLoadError, match="reads text only \\(use Plain\\)"):
        load_spec(_spec(tmp_path, directory), ENGINE, loop=CallerLoop())
