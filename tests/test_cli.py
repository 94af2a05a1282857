from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from inferd.bench.process import free_port, run_server
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


def test_cache_and_schedule_flags_reach_the_engine_config() -> None:
    args = _parser().parse_args(
        ["serve", "--prefix-cache-n", "3", "--max-decode-steps-before-prefill", "2"]
    )
    cfg = EngineConfig(prefix_cache_n=3, max_decode_steps_before_prefill=2)
    assert _engine_config(args) == cfg and cfg.caches_prefixes
    off = _engine_config(_parser().parse_args(["serve", "--prefix-cache-n", "0"]))
    assert off.prefix_cache_n == 0 and not off.caches_prefixes
    bare = _engine_config(_parser().parse_args(["serve", "--no-kv-cache"]))
    assert bare == EngineConfig(no_kv_cache=True) and not bare.caches_prefixes


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prefix-caching", "on", "--prefix-cache-n", "0"], "contradicts --prefix-cache-n 0"),
        (["--prefix-caching", "off", "--prefix-cache-n", "4"], "prefix caching is off"),
        (["--prefix-caching", "on", "--no-kv-cache"], "contradicts --no-kv-cache"),
        (["--no-kv-cache", "--prefix-cache-n", "4"], "no_kv_cache keeps no KV"),
        (["--no-kv-cache", "--speculative", "self"], "needs the KV cache"),
        (["--prefix-cache-n", "-1"], "cannot be negative"),
        (["--max-decode-steps-before-prefill", "0"], "at least 1"),
    ],
)
def test_contradictory_cache_flags_are_refused(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _engine_config(_parser().parse_args(["serve", *flags]))


def test_run_config_chats_with_the_files_default_model(smollm2_gguf: Path, tmp_path: Path) -> None:
    """`inferd run --config FILE` chats with the file's default model (or its first chat
    model): the same greedy answer as `inferd run -m` on that model."""
    config = tmp_path / "models.json"
    models = {
        "embed": {"Embedding": {"model_id": "minilm"}},
        "chat": {"GGUF": {"model_id": str(smollm2_gguf)}, "alias": "talker"},
    }
    config.write_text(json.dumps(models))
    # f32: what is tested is the model chosen, and f32 loads without building packed copies
    ask = ("-p", "Say hello.", "--max-tokens", "6", "--temperature", "0", "--dtype", "f32")
    direct = _inferd("run", "-m", str(smollm2_gguf), *ask)
    first_chat = _inferd("run", "--config", str(config), *ask)
    named = _inferd("run", "--config", str(config), "--default-model-id", "talker", *ask)
    assert direct.returncode == first_chat.returncode == named.returncode == 0, first_chat.stderr
    assert direct.stdout.strip() and first_chat.stdout == direct.stdout == named.stdout
    missing = _inferd("run", "--config", str(config), "--default-model-id", "nope", *ask)
    assert missing.returncode == 2 and "nope is not in" in missing.stderr


def test_multi_model_serves_the_config_as_serve_does(smollm2_gguf: Path, tmp_path: Path) -> None:
    """`inferd multi-model --config FILE` (mistral.rs's spelling) serves the file's models."""
    config = tmp_path / "models.json"
    entry = {"GGUF": {"model_id": str(smollm2_gguf)}, "alias": "chat"}
    config.write_text(json.dumps({"small": entry}))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "inferd", "multi-model", "--config", str(config)]
    command += ["--port", str(port), "--default-model-id", "chat"]
    with run_server(command, url + "/health", tmp_path / "serve.log", 180, "multi-model"):
        deadline = time.monotonic() + 120  # --config loads in the background
        while httpx.get(url + "/ready", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "the config's model never became ready"
            time.sleep(0.2)
        models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
        reply = httpx.post(
            url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
            timeout=60,
        )
    assert {m["id"]: m["status"] for m in models}["chat"] == "loaded"
    assert reply.status_code == 200 and reply.json()["model"] == "chat"
    bare = _inferd("multi-model", "--port", str(free_port()))
    assert bare.returncode == 2 and "--config" in bare.stderr
