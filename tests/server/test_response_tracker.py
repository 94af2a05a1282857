"""ResponseTracker: how far a response got, read off the messages a real ASGI app sends; and the
two middlewares that answer a cut request from it (limits.py's timeout, shutdown.py's drain),
each cutting a Responses stream whose error event must be numbered after the events sent; a
drained OpenAI-style stream that asked for usage gets it on its error event."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from inferd.server import sse
from inferd.server.generation import stream_events
from inferd.server.limits import LimitsMiddleware
from inferd.server.metrics import request_timer
from inferd.server.response_tracker import ResponseTracker
from inferd.server.shutdown import Drain, DrainMiddleware
from inferd.serving.interface import RequestOutput

EVENTS = [b'data: {"n":1}\n\n', b": keep-alive\n\n", b'data: {"n":2}\n\ndata: [DONE]\n\n']


async def _events(request: Request) -> Response:
    async def body() -> AsyncIterator[bytes]:
        for chunk in EVENTS:
            yield chunk

    return StreamingResponse(body(), media_type="text/event-stream")


async def _json(request: Request) -> Response:
    return JSONResponse({"text": "data: not an event\n\ndata: nor this"})


async def _broken(request: Request) -> Response:
    async def body() -> AsyncIterator[bytes]:
        yield b'data: {"n":1}\n\n'
        yield b'data: {"n":2}\n\n'
        raise RuntimeError("the handler failed mid-stream")

    return StreamingResponse(body(), media_type="text/event-stream; charset=utf-8")


async def _stalls(request: Request) -> Response:
    """Two events, then nothing until cancelled; ``stalled`` is set once both went out."""
    await request.body()  # the body is in: a cut now is one while generating

    async def body() -> AsyncIterator[bytes]:
        yield b'event: response.created\ndata: {"sequence_number":0}\n\n'
        yield b'event: response.in_progress\ndata: {"sequence_number":1}\n\n'
        request.app.state.stalled.set()  # asked for a third: the first two were sent
        await asyncio.Event().wait()
        yield b""

    return StreamingResponse(body(), media_type="text/event-stream")


async def _chat_stalls(request: Request) -> Response:
    """inferd's OpenAI-style stream (``stream_events``, the request's timer watching the engine)
    over an engine stream of two tokens that then stalls; usage when ``?usage`` asks."""
    await request.body()

    async def engine() -> AsyncIterator[RequestOutput]:
        for n in (1, 2):
            yield RequestOutput("r", "x", (n,), None, 5, n)
        request.app.state.stalled.set()  # asked for a third: the timer has counted two
        await asyncio.Event().wait()

    def on_output(index: int, out: RequestOutput) -> Iterator[bytes]:
        yield sse.event({"choices": [{"index": index, "delta": {"content": out.text}}]})

    def usage(tokens: int) -> dict[str, Any]:
        counts = {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens}
        return {"choices": [], "usage": counts}

    timer = request_timer(request)
    asked = usage if "usage" in request.query_params else None
    body = stream_events([timer.watch(engine())], 60.0, on_output, asked, timer)
    return StreamingResponse(body, media_type="text/event-stream")


def _app() -> Starlette:
    app = Starlette(
        routes=[
            Route("/events", _events),
            Route("/json", _json),
            Route("/broken", _broken),
            Route("/v1/responses", _stalls, methods=["POST"]),
            Route("/v1/chat/completions", _chat_stalls, methods=["POST"]),
        ]
    )
    app.state.stalled = asyncio.Event()
    return app


def _recording(app: ASGIApp, seen: list[ResponseTracker]) -> ASGIApp:
    async def recorder(scope: Scope, receive: Receive, send: Send) -> None:
        tracker = ResponseTracker()
        seen.append(tracker)
        await app(scope, receive, tracker.wrap(send))

    return recorder


async def _fails_at_once(scope: Scope, receive: Receive, send: Send) -> None:
    raise RuntimeError("the app failed before answering")


def _get(path: str, app: ASGIApp | None = None) -> tuple[ResponseTracker, object]:
    """The tracker of one GET, and its response (or the app's failure)."""
    seen: list[ResponseTracker] = []

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=_recording(app or _app(), seen))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.get(path)

    try:
        result: object = asyncio.run(go())
    except RuntimeError as exc:
        result = exc
    (tracker,) = seen
    return tracker, result


def test_an_event_stream_is_counted_event_by_event_comments_aside() -> None:
    tracker, response = _get("/events")
    assert isinstance(response, httpx.Response) and response.content == b"".join(EVENTS)
    assert tracker == ResponseTracker(started=True, event_stream=True, events=3, finished=True)


def test_a_json_answer_is_no_event_stream_whatever_its_text() -> None:
    tracker, response = _get("/json")
    assert isinstance(response, httpx.Response) and response.status_code == 200
    assert tracker == ResponseTracker(started=True, event_stream=False, events=0, finished=True)


def test_a_stream_that_fails_midway_is_started_and_unfinished() -> None:
    tracker, failure = _get("/broken")
    assert isinstance(failure, RuntimeError)
    assert tracker == ResponseTracker(started=True, event_stream=True, events=2, finished=False)


def test_an_app_that_fails_before_answering_has_started_nothing() -> None:
    tracker, failure = _get("/", _fails_at_once)
    assert isinstance(failure, RuntimeError)
    assert tracker == ResponseTracker(started=False, event_stream=False, events=0, finished=False)


def _last_event(body: bytes) -> dict[str, object]:
    last = body.strip().split(b"\n\n")[-1]
    assert last.startswith(b"event: error\ndata: "), body
    payload: dict[str, object] = json.loads(last.removeprefix(b"event: error\ndata: "))
    return payload


def test_a_timed_out_responses_stream_ends_with_an_error_numbered_after_its_events() -> None:
    async def go() -> httpx.Response:
        app = LimitsMiddleware(_app(), request_timeout=0.05)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/v1/responses", content=b"{}")

    response = asyncio.run(go())  # the backstop cancels the stalled handler
    assert response.status_code == 200
    assert _last_event(response.content) == {
        "type": "error",
        "code": "request_timeout",
        "message": "the request timed out after 0.05s (--request-timeout) while generating",
        "param": None,
        "sequence_number": 2,
    }


@pytest.mark.parametrize("early", [False, True])
def test_a_drained_responses_stream_ends_with_an_error_numbered_after_its_events(
    early: bool,
) -> None:
    async def go() -> httpx.Response:
        inner, drain = _app(), Drain()
        transport = httpx.ASGITransport(app=DrainMiddleware(inner, drain=drain))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            request = asyncio.ensure_future(client.post("/v1/responses", content=b"{}"))
            await inner.state.stalled.wait()
            if early:
                stop = asyncio.ensure_future(drain.run(3600))
                await asyncio.sleep(0)  # the drain is waiting on the running request
                drain.cut_now()
                report = await stop
            else:
                report = await drain.run(0)
            assert (report.finished, report.cut, report.early) == (0, 1, early)
            return await request

    response = asyncio.run(go())
    assert response.status_code == 200
    event = _last_event(response.content)
    assert event["code"] == "server_shutting_down" and event["sequence_number"] == 2
    second = "cut by a second stop signal" if early else "end of the 0s drain"
    assert second in str(event["message"])


@pytest.mark.parametrize("asked", [True, False])
def test_a_drained_chat_stream_carries_the_usage_it_asked_for(asked: bool) -> None:
    """The drain cancels the handler and writes the error event itself: with the usage the
    request's timer counted (what the access log records) when the caller asked for usage."""

    async def go() -> httpx.Response:
        inner, drain = _app(), Drain()
        transport = httpx.ASGITransport(app=DrainMiddleware(inner, drain=drain))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            path = "/v1/chat/completions" + ("?usage" if asked else "")
            request = asyncio.ensure_future(client.post(path, content=b"{}"))
            await inner.state.stalled.wait()
            assert (await drain.run(0)).cut == 1
            return await request

    events = asyncio.run(go()).content.strip().split(b"\n\n")
    assert events[-1] == b"data: [DONE]"
    last = json.loads(events[-2].removeprefix(b"data: "))
    assert last["error"]["code"] == "server_shutting_down"
    counts = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert last.get("usage") == (counts if asked else None)
