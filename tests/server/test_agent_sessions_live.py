"""Agent sessions through the real CLI: a conversation the server keeps under ``session_id``,
listed, read and deleted over HTTP, and still there after a restart on the same store file.

The oracle: a request in a session gets the same prompt (token count) and the same greedy reply
as a stateless request that sends the whole conversation itself.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.live import LiveServer, live_server

FIRST = {"role": "user", "content": "My name is Ada. Say hello to me."}
SECOND = {"role": "user", "content": "What is my name?"}


def _chat(server: LiveServer, **body: Any) -> dict[str, Any]:
    ask = {"max_tokens": 12, "temperature": 0} | body
    reply = httpx.post(server.api + "/chat/completions", json=ask, timeout=120)
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result


def _streamed_text(server: LiveServer, **body: Any) -> str:
    ask = {"max_tokens": 12, "temperature": 0, "stream": True} | body
    text = ""
    with httpx.stream("POST", server.api + "/chat/completions", json=ask, timeout=120) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
    return text


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sessions") / "store.sqlite3"


def _serve(smollm2_gguf: Path, store: Path, log: Path) -> Any:
    return live_server(["-m", str(smollm2_gguf), "--responses-store", str(store)], log)


def test_a_session_keeps_the_conversation_across_requests_and_restarts(
    smollm2_gguf: Path, store: Path, tmp_path: Path
) -> None:
    session = f"s-{uuid.uuid4().hex[:12]}"
    with _serve(smollm2_gguf, store, tmp_path / "a.log") as server:
        first = _chat(server, messages=[FIRST], session_id=session)
        said = first["choices"][0]["message"]["content"]
        second = _chat(server, messages=[SECOND], session_id=session)
        whole = [FIRST, {"role": "assistant", "content": said}, SECOND]
        stateless = _chat(server, messages=whole)
        assert second["usage"]["prompt_tokens"] == stateless["usage"]["prompt_tokens"]
        assert second["choices"][0]["message"] == stateless["choices"][0]["message"]

        # a streamed turn is kept once it has finished, as the client saw it
        third = {"role": "user", "content": "Thanks."}
        streamed = _streamed_text(server, messages=[third], session_id=session)
        listed = httpx.get(server.api + "/agent/sessions").json()["data"]
        mine = next(s for s in listed if s["id"] == session)
        assert mine["message_count"] == 6 and mine["object"] == "agent.session"
    with _serve(smollm2_gguf, store, tmp_path / "b.log") as server:  # a restart
        kept = httpx.get(f"{server.api}/agent/sessions/{session}").json()["messages"]
        assert [m["role"] for m in kept] == ["user", "assistant"] * 3
        assert kept[1]["content"] == said and kept[5]["content"] == streamed
        gone = httpx.delete(f"{server.api}/agent/sessions/{session}")
        assert gone.status_code == 200 and gone.json()["deleted"] is True
        missing = httpx.get(f"{server.api}/agent/sessions/{session}")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "session_not_found"

        bad = [
            {"messages": [SECOND], "session_id": "has space"},
            {"messages": [SECOND], "session_id": "ok", "n": 2},
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is this?"},
                            {"type": "image_url", "image_url": {"url": "data:,"}},
                        ],
                    }
                ],
                "session_id": "ok",
            },
        ]
        for body in bad:
            reply = httpx.post(server.api + "/chat/completions", json=body, timeout=60)
            assert reply.status_code == 400, (body, reply.text)
        assert httpx.get(f"{server.api}/agent/sessions/ok").status_code == 404  # nothing kept
