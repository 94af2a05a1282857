"""Stored Responses (POST /v1/responses with ``store``) in SQLite: the response object, the
input items of its turn, who created it, and when it expires.

One file (``--responses-store``; ``:memory:`` keeps nothing past the process), opened on first
use so servers that never see a Responses request never create it. Every write is one
transaction in WAL mode with ``synchronous=FULL``: a response the server answered with is on
disk, and a process killed mid-write leaves the last committed state (SQLite's journal rolls
the half-written transaction back on the next open). The schema carries a version
(``PRAGMA user_version``); a file of a newer version is refused rather than misread.

A response still queued or in progress records the server process running it (``worker``: its
pid and start time). A process that dies (killed, crashed, stopped with work in flight) leaves
such rows behind; the next server to open the file marks those whose process is gone
``failed``, with an error saying why, so a client polling one learns its fate instead of
waiting forever. Rows of a live process (another server on the same file) are left alone.

Ownership: with API keys, a row records the SHA-256 of the key that created it, and every
read, update and delete is filtered by it, so another key's response is simply not there (the
route answers 404, never 403, which would confirm the id exists). Expiry is a column: rows past
it are invisible at once and purged on later writes.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferd.server.defaults import DEFAULT_RESPONSES_TTL

SCHEMA_VERSION = 2  # 2: responses.worker
MEMORY = ":memory:"
DEFAULT_TTL_SECONDS = DEFAULT_RESPONSES_TTL
_PURGE_EVERY_SECONDS = 60.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    status TEXT NOT NULL,
    background INTEGER NOT NULL DEFAULT 0,
    previous_id TEXT,
    body TEXT NOT NULL,
    worker TEXT
);
CREATE TABLE IF NOT EXISTS input_items (
    response_id TEXT NOT NULL REFERENCES responses(id) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    item_id TEXT NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (response_id, position)
);
CREATE INDEX IF NOT EXISTS responses_expiry ON responses(expires_at);
"""


_log = logging.getLogger(__name__)
_UNFINISHED = ("queued", "in_progress")
ABANDONED = "the server stopped before this response finished; create it again"


class StoreError(Exception):
    """The store file cannot be used (another program's file, a newer schema)."""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    id: str
    owner: str | None
    status: str
    background: bool
    previous_id: str | None
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ItemPage:
    items: list[dict[str, Any]]
    has_more: bool


class ResponseStore:
    """The SQLite store; safe to call from any thread (one connection behind a lock: every
    statement is short, and SQLite serializes writers anyway)."""

    def __init__(self, path: str | Path, ttl_seconds: float = DEFAULT_TTL_SECONDS) -> None:
        if not ttl_seconds > 0:
            raise ValueError("--responses-ttl must be positive")
        self.path = str(path)
        self.ttl = ttl_seconds
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._last_purge = 0.0
        self.worker = _this_process()

    # -- opening -----------------------------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            self._db = self._open()
        return self._db

    def _open(self) -> sqlite3.Connection:
        if self.path != MEMORY:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        # autocommit off at the driver level: transactions are explicit (BEGIN IMMEDIATE)
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            db.execute("PRAGMA foreign_keys = ON")
            if self.path != MEMORY:
                db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = FULL")
            db.execute("PRAGMA busy_timeout = 5000")
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path}: the responses store has schema version {version}; this "
                    f"inferd reads version {SCHEMA_VERSION} (upgrade inferd or use another file)"
                )
            db.execute("BEGIN IMMEDIATE")
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            columns = {row[1] for row in db.execute("PRAGMA table_info(responses)")}
            if "worker" not in columns:  # a version 1 file
                db.execute("ALTER TABLE responses ADD COLUMN worker TEXT")
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            abandoned = _fail_abandoned(db)
            db.execute("COMMIT")
            if abandoned:
                _log.warning("responses store: %d unfinished responses marked failed", abandoned)
        except sqlite3.DatabaseError as exc:
            db.close()
            raise StoreError(f"{self.path}: not a usable responses store: {exc}") from None
        except StoreError:
            db.close()
            raise
        return db

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            db = self._connection()
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def open_if_present(self) -> None:
        """Open an existing store file now (at startup), so that the responses a dead server
        left unfinished are marked failed at once; a missing file stays uncreated, and an
        unusable one is reported by the first request that needs it."""
        if self.path == MEMORY or not Path(self.path).is_file():
            return
        try:
            with self._lock:
                self._connection()
        except StoreError as exc:
            _log.warning("%s", exc)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    # -- writing -----------------------------------------------------------------------------

    def put(
        self,
        body: dict[str, Any],
        items: list[dict[str, Any]],
        *,
        owner: str | None,
        background: bool = False,
    ) -> None:
        """Insert a response (or replace one of the same id and owner) with its input items,
        in one transaction."""
        now = time.time()
        with self._transaction() as db:
            self._purge(db, now)
            db.execute("DELETE FROM responses WHERE id = ?", (body["id"],))
            db.execute(
                "INSERT INTO responses (id, owner, created_at, expires_at, status, background,"
                " previous_id, body, worker) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    body["id"],
                    owner,
                    now,
                    now + self.ttl,
                    body["status"],
                    int(background),
                    body.get("previous_response_id"),
                    _dump(body),
                    self.worker,
                ),
            )
            db.executemany(
                "INSERT INTO input_items (response_id, position, item_id, body)"
                " VALUES (?, ?, ?, ?)",
                [(body["id"], i, item["id"], _dump(item)) for i, item in enumerate(items)],
            )

    def update(self, body: dict[str, Any], *, unless_status: tuple[str, ...] = ()) -> bool:
        """Replace a stored response's body (its status with it); False when it is gone or its
        status is one of ``unless_status`` (a cancelled response stays cancelled)."""
        with self._transaction() as db:
            marks = ",".join("?" * len(unless_status)) or "''"
            cursor = db.execute(
                f"UPDATE responses SET body = ?, status = ? WHERE id = ? AND expires_at > ?"
                f" AND status NOT IN ({marks})",
                (_dump(body), body["status"], body["id"], time.time(), *unless_status),
            )
            return cursor.rowcount == 1

    def delete(self, response_id: str, owner: str | None) -> bool:
        with self._transaction() as db:
            cursor = db.execute(
                "DELETE FROM responses WHERE id = ? AND owner IS ? AND expires_at > ?",
                (response_id, owner, time.time()),
            )
            return cursor.rowcount == 1

    def _purge(self, db: sqlite3.Connection, now: float) -> None:
        if now - self._last_purge < _PURGE_EVERY_SECONDS:
            return
        self._last_purge = now
        db.execute("DELETE FROM responses WHERE expires_at <= ?", (now,))

    # -- reading -----------------------------------------------------------------------------

    def get(self, response_id: str, owner: str | None) -> StoredResponse | None:
        with self._lock:
            row = (
                self._connection()
                .execute(
                    "SELECT id, owner, status, background, previous_id, body FROM responses"
                    " WHERE id = ? AND owner IS ? AND expires_at > ?",
                    (response_id, owner, time.time()),
                )
                .fetchone()
            )
        if row is None:
            return None
        return StoredResponse(row[0], row[1], row[2], bool(row[3]), row[4], json.loads(row[5]))

    def input_items(self, response_id: str) -> list[dict[str, Any]]:
        """Every input item of a response's own turn, first to last."""
        with self._lock:
            rows = (
                self._connection()
                .execute(
                    "SELECT body FROM input_items WHERE response_id = ? ORDER BY position",
                    (response_id,),
                )
                .fetchall()
            )
        return [json.loads(r[0]) for r in rows]

    def item_page(
        self,
        response_id: str,
        *,
        limit: int,
        descending: bool,
        after: str | None = None,
        before: str | None = None,
    ) -> ItemPage | None:
        """A page of a response's input items in the order asked; ``after`` / ``before``: item
        ids the page starts after or ends before (None when such an id is not an item)."""
        order = "DESC" if descending else "ASC"
        cmp_after, cmp_before = (">", "<") if not descending else ("<", ">")
        where = ["response_id = ?"]
        args: list[Any] = [response_id]
        with self._lock:
            db = self._connection()
            for item_id, cmp in ((after, cmp_after), (before, cmp_before)):
                if item_id is None:
                    continue
                row = db.execute(
                    "SELECT position FROM input_items WHERE response_id = ? AND item_id = ?",
                    (response_id, item_id),
                ).fetchone()
                if row is None:
                    return None
                where.append(f"position {cmp} ?")
                args.append(row[0])
            rows = db.execute(
                f"SELECT body FROM input_items WHERE {' AND '.join(where)}"
                f" ORDER BY position {order} LIMIT ?",
                (*args, limit + 1),
            ).fetchall()
        items = [json.loads(r[0]) for r in rows]
        return ItemPage(items[:limit], len(items) > limit)


def _fail_abandoned(db: sqlite3.Connection) -> int:
    """Mark failed the unfinished responses whose server process is gone; how many."""
    marks = ",".join("?" * len(_UNFINISHED))
    rows = db.execute(
        f"SELECT id, worker, body FROM responses WHERE status IN ({marks})", _UNFINISHED
    ).fetchall()
    failed = 0
    for response_id, worker, text in rows:
        if worker is not None and _alive(worker):
            continue
        body = json.loads(text) | {
            "status": "failed",
            "error": {"code": "server_error", "message": ABANDONED},
        }
        db.execute(
            "UPDATE responses SET status = 'failed', body = ? WHERE id = ?",
            (_dump(body), response_id),
        )
        failed += 1
    return failed


def _start_time(pid: int) -> str:
    """When process ``pid`` started (clock ticks since boot, Linux), or "" when unknown: with
    the pid it names one process, as pids are reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[-1].split()[19]  # field 22, counted after the command name


def _this_process() -> str:
    pid = os.getpid()
    return f"{pid}:{_start_time(pid)}"


def _alive(worker: str) -> bool:
    """Whether the process a ``worker`` value names still runs (on this machine: SQLite in WAL
    mode is not shared across machines)."""
    pid_text, _, started = worker.partition(":")
    try:
        pid = int(pid_text)
        os.kill(pid, 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        pass  # another user's process: it exists
    return not started or _start_time(pid) in ("", started)


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
