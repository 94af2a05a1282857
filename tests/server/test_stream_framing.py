"""Stream endings that need the engine to misbehave or be slow: keep-alives and error events."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from inferd.server import sse
from inferd.server.app import build_app
from inferd.server.options import ServerOptions
from inferd.serving.served import ServedModel


async def _post(app: object, body: dict[str, object]) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post("/v1/chat/completions", json=body, timeout=120)


def _events(text: str) -> list[str]:
    return [block for block in text.split("\n\n") if block]


def test_keepalive_comments_flow_while_a_long_prompt_prefills(served_f32: ServedModel) -> None:
    app = build_app([served_f32], ServerOptions(keepalive_seconds=0.005))
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 150
    body = {"messages": [{"role": "user", "content": long_prompt}], "max_tokens": 2, "stream": True}
    resp = asyncio.run(_post(app, body))
    events = _events(resp.text)
    assert resp.status_code == 200
    assert ": keep-alive" in events
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events if e.startswith("data: {")]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_engine_failure_mid_stream_sends_an_error_event_then_done(
    served_f32: ServedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = served_f32.engine.engine
    calls = {"n": 0}
    real_step = engine.step

    def flaky():  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("simulated device fault")
        return real_step()

    monkeypatch.setattr(engine, "step", flaky)
    app = build_app([served_f32])
    body = {
        "messages": [{"role": "user", "content": "Tell a story."}],
        "max_tokens": 50,
        "stream": True,
    }
    events = _events(asyncio.run(_post(app, body)).text)
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1
    error = json.loads(events[-2].removeprefix("data: "))
    assert "simulated device fault" in error["error"]["message"]
    assert not any('"finish_reason":"stop"' in e or '"finish_reason":"length"' in e for e in events)
    monkeypatch.undo()
    stats = served_f32.engine.stats()
    assert stats.running == 0 and stats.kv_blocks_used == 0


def test_heartbeat_never_loses_an_item() -> None:
    async def slow() -> AsyncIterator[int]:
        for i in range(3):
            await asyncio.sleep(0.03)
            yield i

    async def collect() -> list[int | None]:
        return [x async for x in sse.with_heartbeat(slow(), 0.01)]

    got = asyncio.run(collect())
    assert [x for x in got if x is not None] == [0, 1, 2]
    assert None in got
