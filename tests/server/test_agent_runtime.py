"""The server's agent runtime without a model: sources that did not start are retried at most
every RETRY_S seconds, not on every request; a streamed reply's rounds are kept alive and
their failures framed by the protocol."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from inferd.agent.config import AgentConfig, McpServerConfig
from inferd.server import agent_runtime, sse
from inferd.server.agent_loop import Progress, after_rounds
from inferd.server.agent_runtime import AgentRuntime
from inferd.server.errors import APIError
from inferd.server.events import Failure
from inferd.server.limits import RequestTimeoutError


def test_a_source_that_is_down_is_retried_now_and_then() -> None:
    gone = McpServerConfig("gone", command="/nonexistent/mcp-server")
    runtime = AgentRuntime(AgentConfig(mcp_servers=(gone,), permission="allow"))
    retries: list[int] = []

    async def main() -> None:
        box = await runtime.toolbox()
        assert "gone" in box.failures and box.tools() == []
        real_refresh = box.refresh

        async def counted() -> None:
            retries.append(1)
            await real_refresh()

        box.refresh = counted  # type: ignore[method-assign]
        for _ in range(5):  # requests in quick succession: no new attempt
            assert await runtime.toolbox() is box
        assert retries == []
        runtime._tried -= agent_runtime.RETRY_S  # as if RETRY_S seconds had passed
        await runtime.toolbox()
        assert retries == [1] and "gone" in box.failures
        await runtime.close()

    asyncio.run(main())


async def _frames(
    rounds: Any, keepalive: float = 0.01, progress: Progress | None = None
) -> list[bytes]:
    def error(failure: Failure) -> list[bytes]:
        err = failure.error
        return [f"error {err.status} {err.code}".encode()]

    async def then(started: Any) -> AsyncIterator[bytes]:
        yield b"answer"

    return [frame async for frame in after_rounds(rounds, keepalive, error, then, progress)]


def test_a_stream_runs_its_rounds_with_keep_alives_then_answers() -> None:
    async def rounds() -> Any:
        await asyncio.sleep(0.08)
        return object()

    frames = asyncio.run(_frames(rounds))
    assert frames[-1] == b"answer" and len(frames) >= 3
    assert set(frames[:-1]) == {sse.KEEPALIVE}


@pytest.mark.parametrize(
    ("failure", "framed"),
    [
        (
            APIError(400, "the prompt grew past the context", code="context_length_exceeded"),
            b"error 400 context_length_exceeded",
        ),
        (RequestTimeoutError(1.0), b"error 504 request_timeout"),
        (RuntimeError("a bug"), b"error 500 None"),  # still framed: the stream is not cut
    ],
)
def test_a_failed_round_ends_the_stream_in_its_protocols_frames(
    failure: Exception, framed: bytes
) -> None:
    async def rounds() -> Any:
        raise failure

    assert asyncio.run(_frames(rounds)) == [framed]


def test_progress_events_come_as_the_rounds_note_them_then_the_answer() -> None:
    """Each note is sent when it is made (no keep-alive needed meanwhile), a note made just
    before the rounds end is not lost, and keep-alives still fill a silent wait."""
    progress = Progress()

    async def rounds() -> Any:
        progress.note("tool_call", call_id="c1")
        await asyncio.sleep(0.05)  # a silent tool: keep-alives
        progress.note("tool_result", call_id="c1")
        progress.note("tool_call", call_id="c2")  # the last note, right before the end
        return object()

    frames = asyncio.run(_frames(rounds, keepalive=0.01, progress=progress))
    notes = [f for f in frames if f.startswith(b"event:")]
    assert [f.split(b"\n")[0] for f in notes] == [
        b"event: agent_tool_call",
        b"event: agent_tool_result",
        b"event: agent_tool_call",
    ]
    assert b'"call_id":"c2"' in notes[-1]
    assert frames[-1] == b"answer" and sse.KEEPALIVE in frames
    assert frames.index(notes[0]) == 0  # sent at once, not after a keep-alive interval
