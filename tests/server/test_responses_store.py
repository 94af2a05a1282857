"""The SQLite store of responses (server/responses_store.py) on real files: ownership, expiry,
pagination, the schema version, and a process killed mid-write losing nothing committed."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from inferd.server.responses_store import SCHEMA_VERSION, ResponseStore, StoreError


def _body(
    response_id: str, status: str = "completed", previous: str | None = None
) -> dict[str, Any]:
    return {"id": response_id, "status": status, "previous_response_id": previous, "output": []}


def _items(n: int) -> list[dict[str, Any]]:
    return [{"id": f"msg_{i}", "type": "message", "text": str(i)} for i in range(n)]


def test_a_response_is_visible_only_to_its_owner(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "r.sqlite3")
    store.put(_body("resp_a"), _items(2), owner="alice")
    assert store.get("resp_a", "alice") is not None
    assert store.get("resp_a", "bob") is None and store.get("resp_a", None) is None
    assert not store.delete("resp_a", "bob")
    assert store.delete("resp_a", "alice")
    assert store.get("resp_a", "alice") is None
    assert store.input_items("resp_a") == []  # deleting is real: the items went with it


def test_a_response_expires_after_its_ttl(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "r.sqlite3", ttl_seconds=0.3)
    store.put(_body("resp_a"), _items(1), owner=None)
    assert store.get("resp_a", None) is not None
    time.sleep(0.4)
    assert store.get("resp_a", None) is None
    assert not store.update(_body("resp_a", "cancelled"))  # an expired row takes no writes
    store._last_purge = 0.0  # the next write purges expired rows from the file
    store.put(_body("resp_b"), [], owner=None)
    with closing(sqlite3.connect(tmp_path / "r.sqlite3")) as db:
        assert db.execute("SELECT id FROM responses").fetchall() == [("resp_b",)]


def test_pages_of_input_items(tmp_path: Path) -> None:
    store = ResponseStore(":memory:")
    store.put(_body("resp_a"), _items(5), owner=None)
    first = store.item_page("resp_a", limit=2, descending=False)
    assert first is not None and [i["id"] for i in first.items] == ["msg_0", "msg_1"]
    assert first.has_more
    rest = store.item_page("resp_a", limit=10, descending=False, after="msg_1")
    assert rest is not None and [i["id"] for i in rest.items] == ["msg_2", "msg_3", "msg_4"]
    assert not rest.has_more
    down = store.item_page("resp_a", limit=2, descending=True, after="msg_3")
    assert down is not None and [i["id"] for i in down.items] == ["msg_2", "msg_1"]
    before = store.item_page("resp_a", limit=10, descending=False, before="msg_2")
    assert before is not None and [i["id"] for i in before.items] == ["msg_0", "msg_1"]
    assert store.item_page("resp_a", limit=2, descending=False, after="msg_9") is None


def test_a_cancelled_response_stays_cancelled(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "r.sqlite3")
    store.put(_body("resp_a", "queued"), [], owner=None, background=True)
    assert store.update(_body("resp_a", "cancelled"), unless_status=("completed",))
    assert not store.update(_body("resp_a", "completed"), unless_status=("cancelled",))
    stored = store.get("resp_a", None)
    assert stored is not None and stored.status == "cancelled" and stored.background


def test_it_survives_reopening(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    first = ResponseStore(path)
    first.put(_body("resp_a"), _items(3), owner="k")
    first.close()
    again = ResponseStore(path)
    stored = again.get("resp_a", "k")
    assert stored is not None and stored.body == _body("resp_a")
    assert again.input_items("resp_a") == _items(3)


def test_a_newer_schema_or_a_foreign_file_is_refused(tmp_path: Path) -> None:
    newer = tmp_path / "newer.sqlite3"
    db = sqlite3.connect(newer)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(StoreError, match="schema version"):
        ResponseStore(newer).get("resp_a", None)
    foreign = tmp_path / "foreign.sqlite3"
    foreign.write_bytes(b"not a database at all" * 100)
    with pytest.raises(StoreError, match="not a usable"):
        ResponseStore(foreign).get("resp_a", None)


_WRITER = textwrap.dedent(
    """
    import sys
    from inferd.server.responses_store import ResponseStore
    store = ResponseStore(sys.argv[1])
    items = [{"id": f"msg_{i}", "type": "message", "text": "x" * 2000} for i in range(50)]
    n = 0
    while True:
        store.put({"id": f"resp_{n}", "status": "completed", "output": []}, items, owner=None)
        print(n, flush=True)  # printed only once the transaction committed
        n += 1
    """
)


def test_kill_9_mid_write_loses_no_committed_response(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, env=env, text=True
    )
    assert proc.stdout is not None
    committed = -1
    try:
        while committed < 30:  # let it write for a while, then kill it in the middle of one
            line = proc.stdout.readline()
            assert line, "the writer died"
            committed = int(line)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    store = ResponseStore(path)
    for n in range(committed + 1):
        assert store.get(f"resp_{n}", None) is not None, n
        assert len(store.input_items(f"resp_{n}")) == 50  # whole transactions only
    with closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_an_unusable_store_file_is_a_503_naming_it(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from inferd.server.app import build_app
    from inferd.server.options import ServerOptions

    foreign = tmp_path / "foreign.sqlite3"
    foreign.write_bytes(b"not a database at all" * 100)
    app = build_app((), ServerOptions(responses_store=str(foreign)))
    with TestClient(app) as http:
        reply = http.get("/v1/responses/resp_x")
    assert reply.status_code == 503
    error = reply.json()["error"]
    assert error["code"] == "responses_store_unavailable" and str(foreign) in error["message"]


_LEAVER = textwrap.dedent(
    """
    import os, sys
    from inferd.server.responses_store import ResponseStore
    store = ResponseStore(sys.argv[1])
    for n, status in enumerate(("queued", "in_progress", "completed")):
        body = {"id": f"resp_{status}", "status": status, "output": []}
        store.put(body, [], owner="k", background=True)
    os._exit(0)  # dies with two responses unfinished
    """
)


def test_unfinished_responses_of_a_dead_server_are_failed_at_the_next_open(
    tmp_path: Path,
) -> None:
    path = tmp_path / "r.sqlite3"
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    subprocess.run([sys.executable, "-c", _LEAVER, str(path)], env=env, check=True)
    mine = ResponseStore(path)  # this process is alive: its own unfinished row stays so
    mine.put(_body("resp_live", "in_progress"), [], owner="k", background=True)
    mine.close()
    store = ResponseStore(path)
    store.open_if_present()
    for status in ("queued", "in_progress"):
        stored = store.get(f"resp_{status}", "k")
        assert stored is not None and stored.status == "failed"
        assert stored.body["status"] == "failed" and stored.body["error"]["message"]
    done = store.get("resp_completed", "k")
    assert done is not None and done.status == "completed"
    live = store.get("resp_live", "k")
    assert live is not None and live.status == "in_progress"


def test_a_version_1_file_gains_the_worker_column(tmp_path: Path) -> None:
    path = tmp_path / "v1.sqlite3"
    with closing(sqlite3.connect(path)) as db:
        db.executescript(
            "CREATE TABLE responses (id TEXT PRIMARY KEY, owner TEXT, created_at REAL NOT NULL,"
            " expires_at REAL NOT NULL, status TEXT NOT NULL, background INTEGER NOT NULL"
            " DEFAULT 0, previous_id TEXT, body TEXT NOT NULL);"
            "INSERT INTO responses VALUES ('resp_old', NULL, 0, 1e12, 'in_progress', 1, NULL,"
            """ '{"id": "resp_old", "status": "in_progress"}');"""
            "PRAGMA user_version = 1;"
        )
    store = ResponseStore(path)
    old = store.get("resp_old", None)  # no process recorded: abandoned by an older server
    assert old is not None and old.status == "failed"
    store.put(_body("resp_new"), [], owner=None)
    assert store.get("resp_new", None) is not None
    with closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)
