"""Digest-addressed model bundles and engine distributions.

A bundle is a directory of exact files (weights, tokenizer, template, licenses). Its identity
is the sha256 of a canonical manifest listing every file's relative path, size and sha256,
so renaming, adding or editing any file changes it. A published bundle lives at
``<root>/<bundle sha256>/`` and is read-only; the server is only ever pointed at such a path.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from inferd.contract.canonical import digest_of

_CHUNK = 1 << 20
# Python's byte-code caches are rebuilt at will by the interpreter; they are not part of
# what was reviewed, so a distribution digest leaves them out.
_IGNORED_PARTS = frozenset({"__pycache__"})
_IGNORED_SUFFIXES = (".pyc", ".pyo")


class BundleError(ValueError):
    """A bundle that is malformed or does not match its expected digest."""


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def manifest(directory: Path, *, skip_caches: bool = False) -> dict[str, Any]:
    """Every regular file under ``directory``, sorted by relative path.

    Symbolic links are refused: a link can point outside the reviewed bytes, and its target
    can change without the manifest noticing.
    """
    if not directory.is_dir() or directory.is_symlink():
        raise BundleError(f"{directory} is not a directory")
    files = [
        {"path": rel, "bytes": path.stat().st_size, "sha256": file_sha256(path)}
        for rel, path in sorted(_walk(directory, skip_caches))
    ]
    if not files:
        raise BundleError(f"{directory} holds no files")
    return {"files": files}


def _walk(directory: Path, skip_caches: bool) -> Iterator[tuple[str, Path]]:
    for root, dirs, names in os.walk(directory, followlinks=False):
        base = Path(root)
        if skip_caches:
            dirs[:] = [d for d in dirs if d not in _IGNORED_PARTS]
        for d in dirs:
            if (base / d).is_symlink():
                raise BundleError(f"{base / d} is a symbolic link")
        for name in names:
            path = base / name
            if skip_caches and name.endswith(_IGNORED_SUFFIXES):
                continue
            if path.is_symlink() or not path.is_file():
                raise BundleError(f"{path} is not a regular file")
            yield path.relative_to(directory).as_posix(), path


def bundle_sha256(directory: Path) -> str:
    return digest_of(manifest(directory))


def distribution_sha256(package_dir: Path) -> str:
    """Identity of an installed Python distribution's source tree (byte-code caches aside)."""
    return digest_of(manifest(package_dir, skip_caches=True))


def artifact_sha256(path: Path) -> str:
    """A file's sha256, or a directory's distribution digest."""
    return distribution_sha256(path) if path.is_dir() else file_sha256(path)


def verify_bundle(directory: Path, expected: str) -> None:
    if directory.name != expected:
        raise BundleError(f"{directory} is not addressed by its digest {expected}")
    actual = bundle_sha256(directory)
    if actual != expected:
        raise BundleError(f"bundle {directory} has digest {actual}, expected {expected}")


def publish_bundle(files: Mapping[str, Path], root: Path) -> Path:
    """Copy (or hard-link) ``files`` into ``root/<digest>/``, read-only, and return that path.

    Publishing the same files twice returns the same directory; the bytes are staged first
    and only renamed into place once complete, so a reader never sees half a bundle.
    """
    for rel in files:
        _check_relpath(rel)
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".bundle-", dir=root))
    try:
        for rel, source in files.items():
            target = staging / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            _link_or_copy(source, target)
        digest = bundle_sha256(staging)
        final = root / digest
        if final.exists():
            verify_bundle(final, digest)
            return final
        _make_read_only(staging)
        staging.rename(final)
        return final
    finally:
        if staging.exists():
            _make_writable(staging)
            shutil.rmtree(staging)


def tree_files(directory: Path, prefix: str = "") -> dict[str, Path]:
    """Every file of a source tree (byte-code caches aside), keyed for ``publish_bundle``."""
    return {prefix + rel: path for rel, path in _walk(directory, skip_caches=True)}


def _check_relpath(rel: str) -> None:
    path = PurePosixPath(rel)
    if path.is_absolute() or ".." in path.parts or not rel or rel != path.as_posix():
        raise BundleError(f"bundle path {rel!r} must be relative, normalized and inside")


def _link_or_copy(source: Path, target: Path) -> None:
    # A hard link shares the inode, so it is only safe for a source that is already
    # read-only (a store blob): linking a writable file would let an in-place edit change
    # the published bundle, and chmod-ing the bundle would chmod the source too.
    if not source.stat().st_mode & 0o222:
        try:
            os.link(source, target)
            return
        except OSError:
            pass  # another device: copy instead
    shutil.copyfile(source, target)


def _make_read_only(directory: Path) -> None:
    for path in sorted(directory.rglob("*"), reverse=True):
        path.chmod(0o555 if path.is_dir() else 0o444)
    directory.chmod(0o555)


def _make_writable(directory: Path) -> None:
    directory.chmod(0o755)
    for path in directory.rglob("*"):
        if path.is_dir():
            path.chmod(0o755)
