"""The files of /v1/files (files_api.py): their bytes stored by content digest, their metadata
in SQLite beside them.

A folder (``--files-dir``; `inferd serve` puts it beside the responses store, and an app
built without one gets a private temporary folder) holds ``blobs/<sha256>`` and
``files.sqlite3``. Two uploads of the same bytes share one blob; a blob goes when the last
file naming it is deleted. A blob is written to a temporary name and renamed into place, so a
reader never sees half of one.

Ownership is as for stored responses (responses_store.py): a row records the SHA-256 of the
API key that created it, every read and delete is filtered by it, and another key's file is
simply not there (404, never 403). Limits: ``max_file_bytes`` per file, ``max_total_bytes``
for every file of the store together (a file past either is refused, nothing written).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import shutil
import sqlite3
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferd.server.defaults import DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_FILES_TOTAL_BYTES

# The purposes OpenAI's OpenAIFile lists; an upload may name the ones a client sends.
PURPOSES = (
    "assistants",
    "assistants_output",
    "batch",
    "batch_output",
    "fine-tune",
    "fine-tune-results",
    "vision",
    "user_data",
)
UPLOAD_PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
MAX_FILENAME_CHARS = 255

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    owner TEXT,
    created_at INTEGER NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    digest TEXT NOT NULL,
    seq INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS files_owner ON files(owner, seq);
"""


class FileTooLarge(Exception):
    """A file over the per-file limit, or one the store's total cap has no room for."""


@dataclass(frozen=True, slots=True)
class StoredFile:
    id: str
    owner: str | None
    created_at: int
    filename: str
    purpose: str
    bytes: int
    digest: str

    def body(self) -> dict[str, Any]:
        """The file as OpenAI's ``OpenAIFile`` object."""
        purpose = self.purpose if self.purpose in PURPOSES else "user_data"  # "evals"
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": purpose,
            "status": "processed",
        }


@dataclass(frozen=True, slots=True)
class FilePage:
    files: list[StoredFile]
    has_more: bool


def clean_filename(name: str) -> str:
    """A filename as shown back: its last path segment (an upload's name is a label, never a
    path here), control characters dropped, bounded."""
    base = name.replace("\\", "/").rsplit("/", 1)[-1]
    base = "".join(c for c in base if c.isprintable())
    return base[:MAX_FILENAME_CHARS] or "file"


class FileStore:
    """Safe to call from any thread (one connection behind a lock, as ResponseStore)."""

    def __init__(
        self,
        folder: str | Path | None,
        *,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        max_total_bytes: int = DEFAULT_MAX_FILES_TOTAL_BYTES,
    ) -> None:
        self._given = None if folder is None else Path(folder)
        self._folder: Path | None = None
        self.max_file_bytes = max_file_bytes
        self.max_total_bytes = max_total_bytes
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None

    @property
    def folder(self) -> Path:
        if self._folder is None:
            # an app built without a folder: a private one, gone with the process's temp files
            self._folder = self._given or Path(tempfile.mkdtemp(prefix="inferd-files-"))
            (self._folder / "blobs").mkdir(parents=True, exist_ok=True)
        return self._folder

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            db = sqlite3.connect(
                self.folder / "files.sqlite3", check_same_thread=False, isolation_level=None
            )
            db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = FULL")
            db.execute("PRAGMA busy_timeout = 5000")
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            self._db = db
        return self._db

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
            if self._given is None and self._folder is not None:
                shutil.rmtree(self._folder, ignore_errors=True)
                self._folder = None

    # -- writing -----------------------------------------------------------------------------

    def put(self, data: bytes, *, filename: str, purpose: str, owner: str | None) -> StoredFile:
        if len(data) > self.max_file_bytes:
            raise FileTooLarge(
                f"the file is over this server's limit of {self.max_file_bytes} bytes "
                "(--max-file-bytes)"
            )
        digest = hashlib.sha256(data).hexdigest()
        record = StoredFile(
            id="file-" + secrets.token_hex(12),
            owner=owner,
            created_at=int(time.time()),
            filename=clean_filename(filename),
            purpose=purpose,
            bytes=len(data),
            digest=digest,
        )
        with self._lock:
            db = self._connection()
            db.execute("BEGIN IMMEDIATE")
            try:
                total = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM files").fetchone()[0]
                if total + len(data) > self.max_total_bytes:
                    raise FileTooLarge(
                        f"the file store is full ({total} of {self.max_total_bytes} bytes "
                        "used, --max-files-total-bytes); delete files first"
                    )
                self._write_blob(digest, data)
                seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM files").fetchone()[0]
                db.execute(
                    "INSERT INTO files (id, owner, created_at, filename, purpose, bytes, digest,"
                    " seq) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        record.id,
                        owner,
                        record.created_at,
                        record.filename,
                        purpose,
                        record.bytes,
                        digest,
                        seq,
                    ),
                )
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        return record

    def _blob(self, digest: str) -> Path:
        return self.folder / "blobs" / digest

    def _write_blob(self, digest: str, data: bytes) -> None:
        path = self._blob(digest)
        if path.is_file():
            return
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".part-")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temp, path)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise

    def delete(self, file_id: str, owner: str | None) -> bool:
        with self._lock:
            db = self._connection()
            row = db.execute(
                "SELECT digest FROM files WHERE id = ? AND owner IS ?", (file_id, owner)
            ).fetchone()
            if row is None:
                return False
            db.execute("DELETE FROM files WHERE id = ?", (file_id,))
            shared = db.execute("SELECT 1 FROM files WHERE digest = ?", (row[0],)).fetchone()
            if shared is None:
                self._blob(row[0]).unlink(missing_ok=True)
            return True

    def sink(self, owner: str | None) -> Callable[[str, bytes], Awaitable[str]]:
        """Stores a file code execution wrote for ``owner`` (purpose ``assistants``): the
        sandbox's FileSink. A file past the limits is a ValueError saying so."""

        async def save(path: str, data: bytes) -> str:
            try:
                record = await asyncio.to_thread(
                    self.put, data, filename=path, purpose="assistants", owner=owner
                )
            except FileTooLarge as exc:
                raise ValueError(str(exc)) from None
            return record.id

        return save

    # -- reading -----------------------------------------------------------------------------

    def get(self, file_id: str, owner: str | None) -> StoredFile | None:
        with self._lock:
            row = (
                self._connection()
                .execute(
                    f"SELECT {_COLUMNS} FROM files WHERE id = ? AND owner IS ?", (file_id, owner)
                )
                .fetchone()
            )
        return None if row is None else StoredFile(*row)

    def content(self, record: StoredFile) -> bytes:
        return self._blob(record.digest).read_bytes()

    def page(
        self,
        owner: str | None,
        *,
        limit: int,
        descending: bool,
        purpose: str | None = None,
        after: str | None = None,
    ) -> FilePage | None:
        """A page of the owner's files in creation order (None when ``after`` is not one of
        theirs)."""
        where, args = ["owner IS ?"], [owner]
        if purpose is not None:
            where.append("purpose = ?")
            args.append(purpose)
        with self._lock:
            db = self._connection()
            if after is not None:
                row = db.execute(
                    "SELECT seq FROM files WHERE id = ? AND owner IS ?", (after, owner)
                ).fetchone()
                if row is None:
                    return None
                where.append("seq < ?" if descending else "seq > ?")
                args.append(row[0])
            rows = db.execute(
                f"SELECT {_COLUMNS} FROM files WHERE {' AND '.join(where)}"
                f" ORDER BY seq {'DESC' if descending else 'ASC'} LIMIT ?",
                (*args, limit + 1),
            ).fetchall()
        files = [StoredFile(*r) for r in rows]
        return FilePage(files[:limit], len(files) > limit)


_COLUMNS = "id, owner, created_at, filename, purpose, bytes, digest"
