from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from inferd.cli import _engine_config, _parser
from inferd.config import EngineConfig


def _inferd(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "inferd", *args], capture_output=True, text=True, timeout=timeout
    )


def test_help_lists_the_commands() -> None:
    out = _inferd("--help")
    assert out.returncode == 0
    for command in ("serve", "run", "pull", "models"):
        assert command in out.stdout


def test_serve_help_documents_the_safe_default_host() -> None:
    out = _inferd("serve", "--help")
    assert out.returncode == 0
    assert "127.0.0.1" in out.stdout and "--max-seqs" in out.stdout and "--dtype" in out.stdout


def test_run_one_shot_streams_an_answer(smollm2_gguf: Path) -> None:
    out = _inferd(
        "run",
        "-m",
        str(smollm2_gguf),
        "-p",
        "Say hello.",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()


def test_run_interactive_answers_each_line_and_ends_on_eof(smollm2_gguf: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "inferd", "run", "-m", str(smollm2_gguf), "--max-tokens", "6"],
        input="Hi there.\nAnd again?\n",
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count(">>> ") == 3  # two questions answered, then the prompt that saw EOF


def test_missing_model_file_is_a_clear_error() -> None:
    out = _inferd("run", "-m", "/nonexistent/model.gguf", "-p", "x")
    assert out.returncode == 2
    assert "neither a file nor a store name" in out.stderr


def test_engine_flags_default_to_the_engine_config() -> None:
    """The engine's defaults are EngineConfig's; the flags only read them."""
    assert _engine_config(_parser().parse_args(["serve"])) == EngineConfig()
    assert _engine_config(_parser().parse_args(["run"])) == EngineConfig()


def test_deterministic_flag_reaches_the_engine_config() -> None:
    args = _parser().parse_args(["serve", "--deterministic"])
    assert _engine_config(args) == EngineConfig(deterministic=True)


def test_kv_cache_dtype_flag_reaches_the_engine_config() -> None:
    args = _parser().parse_args(["serve", "--kv-cache-dtype", "int8"])
    assert _engine_config(args) == EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--kv-cache-dtype", "fp8"])
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int4")
