"""Agent sessions: a conversation the server keeps, so a client sends only its new turns.

A chat completion with ``session_id`` is answered as if the session's stored messages came
before its own; afterwards its messages, the tool rounds the agent loop ran (each an assistant
turn with its calls and the tools' results) and the reply are appended to the session. The
messages are kept in chat completions' own shape, in SQLite (the file of ``--responses-store``,
a table of its own), so a session survives a restart. A request's turns are kept once it has
its reply: one cut short (the client left, the server stopped) leaves the session as it was,
and its calls that waited for approval with it. With API keys a session belongs to the
key that made it: another key's session of the same id is another session.

    GET    /v1/agent/sessions          the caller's sessions: id, message count, times
    GET    /v1/agent/sessions/{id}     one session: its messages, and the calls of its request
                                       in flight that wait for approval
    DELETE /v1/agent/sessions/{id}     forget it

Bounds: a session holds at most ``MAX_MESSAGES`` messages and ``MAX_BYTES`` of JSON; a request
that would go past either is a 400 before any work. Media parts are not kept (a 400 says so).
"""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from inferd.server.agent_runtime import RanCall
from inferd.server.approvals import ApprovalBroker
from inferd.server.auth import request_owner
from inferd.server.errors import APIError, bad_request

MEMORY = ":memory:"
MAX_MESSAGES = 2000
MAX_BYTES = 8 * 1024 * 1024
_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS agent_sessions (
    owner TEXT NOT NULL,
    id TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    messages TEXT NOT NULL,
    PRIMARY KEY (owner, id)
)
"""


@dataclass(frozen=True, slots=True)
class Session:
    id: str
    owner: str  # "" without API keys
    messages: list[dict[str, Any]]


class SessionStore:
    """Sessions in SQLite; safe from any thread (one connection behind a lock)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            if self.path != MEMORY:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            if self.path != MEMORY:
                db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = FULL")
            db.execute("PRAGMA busy_timeout = 5000")
            db.execute(_SCHEMA)
            self._db = db
        return self._db

    def load(self, session_id: str, owner: str) -> Session:
        """The session (no messages yet when it is new)."""
        with self._lock:
            row = (
                self._connection()
                .execute(
                    "SELECT messages FROM agent_sessions WHERE owner = ? AND id = ?",
                    (owner, session_id),
                )
                .fetchone()
            )
        return Session(session_id, owner, json.loads(row[0]) if row else [])

    def save(self, session: Session) -> None:
        now = time.time()
        text = json.dumps(session.messages, ensure_ascii=False)
        with self._lock:
            self._connection().execute(
                "INSERT INTO agent_sessions VALUES (?, ?, ?, ?, ?) ON CONFLICT (owner, id) "
                "DO UPDATE SET messages = excluded.messages, updated_at = excluded.updated_at",
                (session.owner, session.id, now, now, text),
            )

    def listing(self, owner: str) -> list[dict[str, Any]]:
        with self._lock:
            rows = (
                self._connection()
                .execute(
                    "SELECT id, created_at, updated_at, json_array_length(messages) "
                    "FROM agent_sessions WHERE owner = ? ORDER BY updated_at DESC",
                    (owner,),
                )
                .fetchall()
            )
        return [_summary(*row) for row in rows]

    def delete(self, session_id: str, owner: str) -> bool:
        with self._lock:
            cursor = self._connection().execute(
                "DELETE FROM agent_sessions WHERE owner = ? AND id = ?", (owner, session_id)
            )
        return cursor.rowcount > 0


def _summary(session_id: str, created: float, updated: float, count: int) -> dict[str, Any]:
    return {
        "id": session_id,
        "object": "agent.session",
        "created_at": int(created),
        "updated_at": int(updated),
        "message_count": count,
    }


# -- a request's session ------------------------------------------------------------------------


def owner_of(request: Request) -> str:
    """The session's owner column: the key's owner, "" without keys."""
    return request_owner(request) or ""


async def open_session(
    request: Request, session_id: str, new: Sequence[dict[str, Any]], n: int
) -> Session:
    """The session a request continues; 400s for a bad id, ``n`` above 1, media parts, and
    a session that the request would take past its bounds."""
    if not _ID.fullmatch(session_id):
        raise bad_request("session_id must be 1 to 128 letters, digits, or _ . : -", "session_id")
    if n != 1:
        raise bad_request("session_id: a session continues one choice; send n: 1", "n")
    if any(isinstance(m.get("content"), list) for m in new):
        raise bad_request(
            "session_id: messages with content parts (images, audio) are not kept in sessions; "
            "send text",
            "session_id",
        )
    store = _store(request)
    session = await asyncio.to_thread(store.load, session_id, owner_of(request))
    request.state.agent_session = session_id  # its calls waiting for approval name it
    size = len(json.dumps([*session.messages, *new], ensure_ascii=False).encode())
    if len(session.messages) + len(new) >= MAX_MESSAGES or size >= MAX_BYTES:
        raise bad_request(
            f"session_id: the session {session_id!r} is full (at most {MAX_MESSAGES} messages "
            f"and {MAX_BYTES} bytes); delete it or start another",
            "session_id",
        )
    return session


async def keep(
    request: Request,
    session: Session,
    new: Sequence[dict[str, Any]],
    ran: Sequence[RanCall],
    reply: dict[str, Any],
) -> None:
    """Append a request's turns to its session: its messages, the tool rounds, the reply."""
    messages = [*session.messages, *new, *tool_turns(ran), _assistant(reply)]
    updated = Session(session.id, session.owner, messages)
    await asyncio.to_thread(_store(request).save, updated)


def tool_turns(ran: Sequence[RanCall]) -> list[dict[str, Any]]:
    """The loop's rounds as chat messages: per round, the assistant's calls and their results."""
    turns: list[dict[str, Any]] = []
    rounds = sorted({c.round for c in ran})
    for number in rounds:
        calls = [c for c in ran if c.round == number]
        made = [
            {
                "id": c.call_id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in calls
        ]
        turns.append({"role": "assistant", "content": None, "tool_calls": made})
        turns += [
            {
                "role": "tool",
                "tool_call_id": c.call_id,
                "content": f"error: {c.result.content}" if c.result.is_error else c.result.content,
            }
            for c in calls
        ]
    return turns


def _assistant(reply: dict[str, Any]) -> dict[str, Any]:
    message = {"role": "assistant", "content": reply.get("content")}
    if reply.get("tool_calls"):
        message["tool_calls"] = reply["tool_calls"]
    return message


def _store(request: Request) -> SessionStore:
    store: SessionStore = request.app.state.inferd.sessions
    return store


# -- routes -------------------------------------------------------------------------------------


async def list_sessions(request: Request) -> Response:
    data = await asyncio.to_thread(_store(request).listing, owner_of(request))
    return JSONResponse({"object": "list", "data": data})


async def get_session(request: Request) -> Response:
    session_id = request.path_params["session_id"]
    session = await asyncio.to_thread(_store(request).load, session_id, owner_of(request))
    broker: ApprovalBroker = request.app.state.inferd.agent.broker
    waiting = [p.listing() for p in broker.waiting(request_owner(request), session_id)]
    if not session.messages and not waiting:
        raise _not_found(session_id)
    body = {
        "id": session_id,
        "object": "agent.session",
        "messages": session.messages,
        "pending_approvals": waiting,
    }
    return JSONResponse(body)


async def delete_session(request: Request) -> Response:
    session_id = request.path_params["session_id"]
    if not await asyncio.to_thread(_store(request).delete, session_id, owner_of(request)):
        raise _not_found(session_id)
    return JSONResponse({"id": session_id, "object": "agent.session", "deleted": True})


def _not_found(session_id: str) -> APIError:
    return APIError(404, f"no session {session_id!r}", param="session_id", code="session_not_found")
