"""``--hf-config-overrides``: a JSON object merged into a Hugging Face directory's config.json
before loading, through the real CLI; refused at startup for a GGUF file or a non-object."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from inferd.loading.hf_model import merged_config
from tests.models.tiny import save_tiny
from tests.server.live import live_server

SERVE = [sys.executable, "-m", "inferd", "serve", "--port", "0"]


def test_objects_merge_key_by_key_and_other_values_replace() -> None:
    base = {"a": 1, "rope_scaling": {"type": "linear", "factor": 2.0}, "layers": [1, 2]}
    merged = merged_config(base, {"rope_scaling": {"factor": 4.0}, "layers": [3], "b": None})
    assert merged == {
        "a": 1,
        "rope_scaling": {"type": "linear", "factor": 4.0},
        "layers": [3],
        "b": None,
    }
    assert base["rope_scaling"] == {"type": "linear", "factor": 2.0}  # the base is untouched


def test_the_served_model_takes_the_overridden_config(tmp_path: Path) -> None:
    """The tiny checkpoint is trained for 128 positions; overridden to 48, the startup line
    says the served context is 48, and a prompt longer than that is refused."""
    save_tiny("llama", tmp_path / "model")
    overrides = json.dumps({"max_position_embeddings": 48})
    args = ["-m", str(tmp_path / "model"), "--hf-config-overrides", overrides]
    with live_server(args, tmp_path / "serve.log") as server:
        lines = server.log.read_text().splitlines()
        engine = next(ln for ln in lines if ln.startswith("inferd  engine "))
        assert "context 48" in engine, engine
        body = {"prompt": "a b c d e f g h " * 10, "max_tokens": 1}
        reply = httpx.post(server.api + "/completions", json=body, timeout=60)
        assert reply.status_code == 400, reply.text
        assert "48" in reply.json()["error"]["message"]


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("[1, 2]", "hf_config_overrides must be a JSON object, got list"),
        ("{not json", "hf_config_overrides is not JSON"),
    ],
)
def test_a_malformed_value_is_refused_at_startup(value: str, says: str, tmp_path: Path) -> None:
    save_tiny("llama", tmp_path / "model")
    command = [*SERVE, "-m", str(tmp_path / "model"), "--hf-config-overrides", value]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert says in result.stderr, result.stderr


def test_a_gguf_model_refuses_overrides(smollm2_gguf: Path) -> None:
    command = [*SERVE, "-m", str(smollm2_gguf), "--hf-config-overrides", '{"rope_theta": 1.0}']
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "apply to a Hugging Face directory's config.json" in result.stderr, result.stderr
