"""Digest-addressed bundles and distribution digests."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from inferd.contract.bundle import (
    BundleError,
    bundle_sha256,
    distribution_sha256,
    publish_bundle,
    verify_bundle,
)


def _files(tmp_path: Path) -> dict[str, Path]:
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.gguf").write_bytes(b"GGUF" + bytes(100))
    (src / "LICENSE").write_text("Apache-2.0\n")
    return {"model.gguf": src / "model.gguf", "licenses/LICENSE": src / "LICENSE"}


def test_publish_is_digest_addressed_read_only_and_idempotent(tmp_path: Path) -> None:
    root = tmp_path / "models"
    first = publish_bundle(_files(tmp_path), root)
    assert first.parent == root and first.name == bundle_sha256(first)
    assert stat.S_IMODE((first / "model.gguf").stat().st_mode) == 0o444
    assert stat.S_IMODE(first.stat().st_mode) == 0o555
    verify_bundle(first, first.name)
    again = tmp_path / "again"
    again.mkdir()
    assert publish_bundle(_files(again), root) == first  # same bytes from elsewhere
    assert sorted(p.name for p in root.iterdir()) == [first.name]


def test_any_change_moves_the_digest(tmp_path: Path) -> None:
    files = _files(tmp_path)
    base = publish_bundle(files, tmp_path / "a")
    renamed = publish_bundle(
        {"weights.gguf": files["model.gguf"], "licenses/LICENSE": files["licenses/LICENSE"]},
        tmp_path / "b",
    )
    fewer = publish_bundle({"model.gguf": files["model.gguf"]}, tmp_path / "c")
    assert len({base.name, renamed.name, fewer.name}) == 3


def test_verify_catches_tampering_and_misnaming(tmp_path: Path) -> None:
    bundle = publish_bundle(_files(tmp_path), tmp_path / "models")
    with pytest.raises(BundleError, match="addressed"):
        verify_bundle(bundle, "0" * 64)
    (bundle / "model.gguf").chmod(0o644)
    (bundle / "model.gguf").write_bytes(b"GGUF tampered")
    with pytest.raises(BundleError, match="expected"):
        verify_bundle(bundle, bundle.name)


def test_symlinks_and_escaping_paths_are_refused(tmp_path: Path) -> None:
    files = _files(tmp_path)
    for bad in ("../x", "/abs", "a/../b", ""):
        with pytest.raises(BundleError):
            publish_bundle({bad: files["model.gguf"]}, tmp_path / "m")
    d = tmp_path / "linked"
    d.mkdir()
    os.symlink(files["model.gguf"], d / "model.gguf")
    with pytest.raises(BundleError, match="regular file"):
        bundle_sha256(d)


def test_distribution_digest_ignores_bytecode_caches(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("x = 1\n")
    before = distribution_sha256(pkg)
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"\x00")
    assert distribution_sha256(pkg) == before
    (pkg / "__init__.py").write_text("x = 2\n")
    assert distribution_sha256(pkg) != before
