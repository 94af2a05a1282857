"""``-m org/name[@revision]`` from the local Hugging Face cache layout, without a network."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
from pathlib import Path

import httpx
import pytest

from inferd.config import EngineConfig
from inferd.hf_cache import is_repo_id, resolve_snapshot, split_revision
from inferd.server.app import build_app
from inferd.serving.served import load_model
from inferd.source import resolve_source
from inferd.store import StoreError
from tests.models.tiny import save_tiny

REPO = "tiny-org/tiny-llama"


def cache_snapshot(
    hub: Path, repo_id: str, files: Path, commit: str, refs: tuple[str, ...]
) -> Path:
    """Lay ``files`` out as huggingface_hub does: blobs named by their etag (sha256 for LFS
    files, git's sha1 for small ones), snapshot entries linking to them, refs naming commits."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for path in sorted(p for p in files.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.suffix in (".safetensors", ".gguf"):
            etag = hashlib.sha256(data).hexdigest()
        else:
            etag = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        blob = repo / "blobs" / etag
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / path.relative_to(files)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    save_tiny("llama", tmp_path / "v1", seed=1)
    save_tiny("llama", tmp_path / "v2", seed=2)
    hub = tmp_path / "hf" / "hub"
    cache_snapshot(hub, REPO, tmp_path / "v1", "a" * 40, ("v1.0",))
    cache_snapshot(hub, REPO, tmp_path / "v2", "b" * 40, ("main",))
    return hub


def test_repo_ids_and_revisions() -> None:
    assert is_repo_id("org/name") and is_repo_id("org/name@v1")
    assert not is_repo_id("smollm2") and not is_repo_id("/abs/path") and not is_repo_id("a/b/c")
    assert split_revision("org/name@abc") == ("org/name", "abc")
    assert split_revision("org/name") == ("org/name", None)


def test_served_from_the_cache_with_revision_and_digests(
    hub: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="inferd.hf_cache"):
        source = resolve_source(REPO)
    assert source.revision == "b" * 40 and source.name == REPO and source.path.is_dir()
    files = dict(source.file_digests)
    weights = (source.path / "model.safetensors").read_bytes()
    assert files["model.safetensors"] == hashlib.sha256(weights).hexdigest()
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    logged = caplog.text  # printed at startup: the revision and every file's digest
    assert f"revision {'b' * 40} (main)" in logged
    assert f"sha256:{files['model.safetensors']}  model.safetensors" in logged

    served = load_model(source, EngineConfig(dtype="f32", kv_cache_tokens=64), progress=False)
    try:

        async def get() -> httpx.Response:
            transport = httpx.ASGITransport(app=build_app([served]))
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                return await client.get("/v1/models")

        (card,) = asyncio.run(get()).json()["data"]
    finally:
        served.shutdown()
    assert card["id"] == REPO and card["revision"] == "b" * 40
    assert card["files"]["model.safetensors"] == f"sha256:{files['model.safetensors']}"


@pytest.mark.parametrize("revision", ["v1.0", "a" * 40, "aaaaaaa"])
def test_revision_by_tag_commit_or_prefix(hub: Path, revision: str) -> None:
    assert resolve_source(REPO, revision=revision).revision == "a" * 40
    assert resolve_source(f"{REPO}@{revision}").revision == "a" * 40


def test_what_is_missing_is_said(hub: Path) -> None:
    with pytest.raises(StoreError, match="does not download from the Hub"):
        resolve_source("nobody/nothing")
    with pytest.raises(StoreError, match=r"revision 'v9' is not in the local cache.*aaaa"):
        resolve_snapshot(REPO, "v9")


def test_a_corrupt_blob_is_reported(hub: Path) -> None:
    snapshot = hub / ("models--" + REPO.replace("/", "--")) / "snapshots" / ("b" * 40)
    blob = (snapshot / "model.safetensors").resolve()
    data = bytearray(blob.read_bytes())
    data[100] ^= 1
    blob.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="the cache is corrupt"):
        resolve_source(REPO)


def test_a_gguf_only_repo_serves_its_file(hub: Path, smollm2_gguf: Path, tmp_path: Path) -> None:
    files = tmp_path / "gguf-repo"
    files.mkdir()
    shutil.copy(smollm2_gguf, files / "model.Q4_1.gguf")
    cache_snapshot(hub, "org/smol-gguf", files, "c" * 40, ("main",))
    source = resolve_source("org/smol-gguf")
    assert source.path.name == "model.Q4_1.gguf" and source.revision == "c" * 40
    assert source.digest == resolve_source(str(smollm2_gguf)).digest


def test_serve_a_cached_revision_quantized(hub: Path, tmp_path: Path) -> None:
    """`inferd serve -m org/name --revision R --isq q4`: a Plain model from the HF cache."""
    import openai

    from tests.server.live import live_server

    args = ["-m", REPO, "--revision", "v1.0", "--isq", "q4", "--dtype", "f32"]
    with live_server([*args, "--kv-cache-tokens", "256"], tmp_path / "serve.log") as server:
        card = httpx.get(server.api + "/models", timeout=10).json()["data"][0]
        info = httpx.get(server.api + "/system/info", timeout=10).json()
        with openai.OpenAI(
            base_url=server.api, api_key="x", max_retries=0, _strict_response_validation=True
        ) as client:
            reply = client.chat.completions.create(
                model=card["id"],
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=5,
                temperature=0,
            )
    assert card["id"] == f"{REPO}@v1.0" and card["revision"] == "a" * 40
    assert card["quantization"] == "q4" and "model.safetensors" in card["files"]
    assert info["server"]["models"][0]["kernels"]["packed_int4"] == 8
    assert reply.usage is not None and reply.usage.completion_tokens >= 1
    log = (tmp_path / "serve.log").read_text()
    assert f"revision {'a' * 40} (v1.0)" in log and "sha256:" in log
