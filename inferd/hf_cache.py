"""``-m org/name[@revision]``: a model from the local Hugging Face cache, without a network.

The cache layout (what ``huggingface_hub`` writes)::

    $HF_HUB_CACHE (default $HF_HOME/hub, default ~/.cache/huggingface/hub)
      models--org--name/
        refs/main                     the commit a branch or tag points at
        snapshots/<commit>/<files>    links into blobs/ (or plain files)
        blobs/<etag>                  contents; an LFS file's etag is its sha256

A revision is a branch or tag name (looked up in ``refs/``), a full commit hash, or a unique
prefix of one. Every file of the snapshot is hashed (sha256) once; an LFS blob whose name is a
sha256 that does not match its content is reported as a corrupt cache.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from inferd.store import StoreError, sha256_file

log = logging.getLogger(__name__)

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def hub_cache() -> Path:
    if env := os.environ.get("HF_HUB_CACHE"):
        return Path(env).expanduser()
    home = os.environ.get("HF_HOME")
    base = Path(home).expanduser() if home else Path.home() / ".cache" / "huggingface"
    return base / "hub"


def split_revision(source: str) -> tuple[str, str | None]:
    """``org/name@rev`` -> (``org/name``, ``rev``); no ``@``: (source, None)."""
    repo, sep, rev = source.partition("@")
    return (repo, rev or None) if sep else (source, None)


def is_repo_id(source: str) -> bool:
    """``org/name`` (optionally ``@revision``) that is not a path on disk."""
    repo, _ = split_revision(source)
    return bool(_REPO_ID.match(repo)) and not Path(source).expanduser().exists()


@dataclass(frozen=True, slots=True)
class Snapshot:
    repo_id: str
    revision: str  # the commit hash
    ref: str | None  # the branch or tag asked for (None: a commit was given)
    path: Path  # the snapshot directory
    files: dict[str, str]  # relpath -> sha256 of every file
    entry: Path  # what to load: the directory, or its single .gguf file

    @property
    def digest(self) -> str:
        """One digest over the files (``source.directory_digest``'s rule), or the single
        .gguf file's own sha256 when that file is the model."""
        if self.entry != self.path:
            return self.files[self.entry.relative_to(self.path).as_posix()]
        joined = "\n".join(f"{rel}:{d}" for rel, d in sorted(self.files.items()))
        return hashlib.sha256(joined.encode()).hexdigest()


def resolve_snapshot(
    repo_id: str, revision: str | None = None, cache: Path | None = None
) -> Snapshot:
    """Find ``repo_id`` at ``revision`` (default ``main``) in the cache; StoreError says what
    is missing and how to get it (inferd never downloads from the Hub itself)."""
    if not _REPO_ID.match(repo_id):
        raise StoreError(f"{repo_id!r} is not a Hugging Face repo id (org/name)")
    cache = cache or hub_cache()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    hint = f"fetch it first, e.g. `huggingface-cli download {repo_id}`"
    if not repo.is_dir():
        raise StoreError(
            f"{repo_id} is neither a local path nor in the local Hugging Face cache ({cache}); "
            f"inferd does not download from the Hub: {hint}"
        )
    ref = revision or "main"
    commit = _commit_of(repo, ref)
    if commit is None:
        known = sorted(p.name for p in (repo / "snapshots").glob("*")) if repo.exists() else []
        raise StoreError(
            f"{repo_id}: revision {ref!r} is not in the local cache (cached snapshots: "
            f"{', '.join(known) or 'none'}); fetch it first, e.g. "
            f"`huggingface-cli download {repo_id} --revision {ref}`"
        )
    path = repo / "snapshots" / commit
    files = _hash_files(path)
    if not files:
        raise StoreError(f"{repo_id}@{commit}: the cached snapshot is empty")
    snapshot = Snapshot(
        repo_id=repo_id,
        revision=commit,
        ref=None if _COMMIT.match(ref) and ref == commit else ref,
        path=path,
        files=files,
        entry=_entry(path, files, repo_id),
    )
    log.info(
        "model %s: revision %s%s from %s",
        repo_id,
        commit,
        f" ({snapshot.ref})" if snapshot.ref else "",
        path,
    )
    for rel, digest in sorted(files.items()):
        log.info("  sha256:%s  %s", digest, rel)
    return snapshot


def _commit_of(repo: Path, ref: str) -> str | None:
    ref_file = repo / "refs" / ref
    if ref_file.is_file():
        commit = ref_file.read_text().strip()
        return commit if (repo / "snapshots" / commit).is_dir() else None
    if re.fullmatch(r"[0-9a-f]{4,40}", ref):
        matches = [p.name for p in (repo / "snapshots").glob(f"{ref}*") if p.is_dir()]
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise StoreError(f"revision {ref!r} is ambiguous: {', '.join(sorted(matches))}")
    return None


def _hash_files(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path)
        if not p.is_file() or any(part.startswith(".") for part in rel.parts):
            continue
        digest = sha256_file(p)
        blob = p.resolve().name
        if _SHA256.match(blob) and blob != digest:
            raise StoreError(
                f"{p}: the cached blob {blob} has sha256 {digest}; the cache is corrupt "
                "(delete the file and download it again)"
            )
        out[rel.as_posix()] = digest
    return out


def _entry(path: Path, files: dict[str, str], repo_id: str) -> Path:
    """The directory for a transformers layout; the .gguf file for a GGUF-only repo."""
    if "config.json" in files and any(rel.endswith(".safetensors") for rel in files):
        return path
    ggufs = sorted(rel for rel in files if rel.endswith(".gguf"))
    if len(ggufs) == 1:
        return path / ggufs[0]
    if ggufs:
        raise StoreError(
            f"{repo_id} holds several .gguf files ({', '.join(ggufs)}); pass the one to serve "
            "as a path, or name it with quantized_filename in a models file"
        )
    return path
