"""Stored conversations outlive the server that stored them, live: `inferd serve` of the default
model on a responses store file is stopped (SIGTERM, a graceful stop; and kill -9 with writes
in flight), and a new server on the same file carries on.

- After either stop, every response the first server answered is there, equal to what the
  client got, and a conversation chained by ``previous_response_id`` continues with its whole
  history (the fourth turn's prompt holds the three before it).
- kill -9 lands while clients are creating responses: each one that got its answer is stored
  whole (the store commits before the route answers), and the store file is intact.
- A background response that was running when the server died is ``failed`` at the next
  startup, with an error saying why, not ``in_progress`` forever.
"""

from __future__ import annotations

import signal
import sqlite3
import threading
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import openai

from tests.server.live import LiveServer, live_server
from tests.server.test_responses_live import _args, _client, _create, _three_turns


def _continues(again: openai.OpenAI, turns: list[Any]) -> None:
    """The conversation goes on from the stored turns, history and all."""
    last = turns[-1]
    assert again.responses.retrieve(last.id).model_dump() == last.model_dump()
    fourth = _create(again, input="And where?", previous_response_id=last.id, max_output_tokens=2)
    assert fourth.status in ("completed", "incomplete")
    assert fourth.usage.input_tokens > last.usage.input_tokens + last.usage.output_tokens
    items = again.responses.input_items.list(fourth.id, limit=100)
    assert len(items.data) >= 1 and fourth.previous_response_id == last.id


def test_sigterm_then_restart(smollm2_gguf: Path, tmp_path: Path) -> None:
    store = tmp_path / "responses.sqlite3"
    with live_server(_args(smollm2_gguf, store), tmp_path / "first.log") as first:
        with _client(first) as client:
            turns = _three_turns(client)
        first.process.send_signal(signal.SIGTERM)
        assert first.process.wait(60) == 0  # a graceful stop
    second = live_server(_args(smollm2_gguf, store), tmp_path / "second.log")
    with second as live, _client(live) as again:
        _continues(again, turns)


def _keep_creating(server: LiveServer, answered: list[Any], stop: threading.Event) -> None:
    """Create stored responses one after another until the server dies; keep the answered."""
    with _client(server) as client:
        while not stop.is_set():
            try:
                answered.append(_create(client, input="Count to three.", max_output_tokens=3))
            except (openai.APIConnectionError, openai.APIStatusError):
                return


def test_kill_9_mid_write_then_restart(smollm2_gguf: Path, tmp_path: Path) -> None:
    store = tmp_path / "responses.sqlite3"
    answered: list[Any] = []
    stop = threading.Event()
    args = [*_args(smollm2_gguf, store), "--max-seq-len", "2048"]  # room for a long reply
    first = live_server(args, tmp_path / "first.log")
    with first as live, _client(live) as client:
        turns = _three_turns(client)
        # counting is what a small model goes on doing: still running when the kill lands
        count = "Count from 1 to 500 with commas: 1, 2, 3, 4,"
        running = _create(client, input=count, background=True, max_output_tokens=1500)
        writers = [
            threading.Thread(target=_keep_creating, args=(live, answered, stop)) for _ in range(2)
        ]
        for writer in writers:
            writer.start()
        deadline = time.monotonic() + 120
        while len(answered) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        current = client.responses.retrieve(running.id)
        live.process.send_signal(signal.SIGKILL)  # with requests in flight
        live.process.wait(30)
        stop.set()
        for writer in writers:
            writer.join(60)
    assert len(answered) >= 2 and current.status == "in_progress"
    with closing(sqlite3.connect(store)) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    second = live_server(args, tmp_path / "second.log")
    with second as live, _client(live) as again:
        # marked at startup, before any request reached the store
        with closing(sqlite3.connect(store)) as db:
            row = db.execute("SELECT status FROM responses WHERE id = ?", (running.id,))
            assert row.fetchone() == ("failed",)
        for response in answered:  # every answered response, whole
            assert again.responses.retrieve(response.id).model_dump() == response.model_dump()
        died = again.responses.retrieve(running.id)
        assert died.status == "failed" and died.error is not None
        assert "stopped" in died.error.message
        _continues(again, turns)
