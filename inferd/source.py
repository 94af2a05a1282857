"""What a model source names: a .gguf file, a model directory, a store name (pulled first when
missing) or a Hugging Face cache id, resolved to its files and their digest."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from inferd.hf_cache import is_repo_id, resolve_snapshot, split_revision
from inferd.store import CATALOG, ModelStore, StoreError, sha256_file

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelSource:
    name: str  # the id the API serves it under
    path: Path
    digest: str
    revision: str | None = None  # the commit, for a Hugging Face cache snapshot
    file_digests: tuple[tuple[str, str], ...] = ()  # (relpath, sha256) of a HF snapshot


def resolve_source(
    source: str, store: ModelStore | None = None, *, revision: str | None = None
) -> ModelSource:
    """A path to a .gguf file or a model directory, a store name (pulled first when
    missing), or a Hugging Face repo id ``org/name[@revision]`` found in the local HF cache
    (``revision`` given separately wins over one in the string)."""
    if is_repo_id(source) and source not in CATALOG:
        repo_id, rev = split_revision(source)
        snap = resolve_snapshot(repo_id, revision or rev)
        return ModelSource(
            name=source,
            path=snap.entry,
            digest=snap.digest,
            revision=snap.revision,
            file_digests=tuple(sorted(snap.files.items())),
        )
    path = Path(source).expanduser()
    if path.is_file():
        return ModelSource(name=path.stem, path=path.resolve(), digest=sha256_file(path))
    if path.is_dir():
        return ModelSource(name=path.name, path=path.resolve(), digest=directory_digest(path))
    store = store or ModelStore()
    if source in CATALOG:
        entry = store.entry_path(source)
        if entry is None:
            log.info("model %s is not in the store yet; pulling it", source)
            store.pull(source)
            entry = store.entry_path(source)
        manifest = store.manifest(source)
        assert entry is not None and manifest is not None
        return ModelSource(name=source, path=entry, digest=manifest.digest)
    raise StoreError(
        f"model {source!r} is neither a file nor a store name (nor a directory); pass a path "
        f"to a .gguf file or a model directory, or one of: {', '.join(sorted(CATALOG))} "
        "(see `inferd pull`)"
    )


def directory_digest(path: Path) -> str:
    """One digest for a model directory, computed as the store's manifests do: sha256 over the
    sorted ``relpath:sha256`` lines of its files (hidden files aside)."""
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    joined = "\n".join(f"{p.relative_to(path).as_posix()}:{sha256_file(p)}" for p in files)
    return hashlib.sha256(joined.encode()).hexdigest()
