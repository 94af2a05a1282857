"""The neutral event stream (server/events.py) over hand-made engine streams: the order of
pieces, the one End or Failure, the status each failure maps to, and closing aborting every
engine request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest

from inferd.server.errors import APIError
from inferd.server.events import End, Event, Failure, KeepAlive, Piece, events, failure_of
from inferd.server.generation import openai_error
from inferd.server.limits import RequestTimeoutError
from inferd.serving.interface import (
    ADAPTER_CHANGED,
    AdmissionError,
    EngineBusyError,
    RequestOutput,
)


def _out(text: str, tokens: int, finish: str | None = None, **more: object) -> RequestOutput:
    return RequestOutput("r", text, (1,), finish, 3, tokens, **more)  # type: ignore[arg-type]


class _Stream:
    """An engine stream of ``outputs`` (or an exception), ``delay`` seconds apart; records
    whether it was closed before its end (an abort)."""

    def __init__(self, outputs: Sequence[RequestOutput | Exception], delay: float = 0.0) -> None:
        self.outputs, self.delay = list(outputs), delay
        self.closed_early = False
        self._gen = self._run()

    async def _run(self) -> AsyncIterator[RequestOutput]:
        done = False
        try:
            for item in self.outputs:
                await asyncio.sleep(self.delay)
                if isinstance(item, Exception):
                    raise item
                yield item
            done = True
        finally:
            self.closed_early = not done

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._gen

    async def __anext__(self) -> RequestOutput:
        return await self._gen.__anext__()


def _all(streams: Sequence[_Stream], keepalive: float | None = None) -> list[Event]:
    async def run() -> list[Event]:
        return [event async for event in events(streams, keepalive)]

    return asyncio.run(run())


def test_pieces_come_per_choice_then_one_end_with_each_choice_last_output() -> None:
    a = _Stream([_out("Hel", 1), _out("lo", 2, "stop")])
    b = _Stream([_out("Hi", 1), _out("!", 2), _out("", 3, "length")])
    got = _all([a, b])
    pieces = [e for e in got if isinstance(e, Piece)]
    assert [e.output.text for e in pieces if e.index == 0] == ["Hel", "lo"]
    assert [e.output.text for e in pieces if e.index == 1] == ["Hi", "!", ""]
    end = got[-1]
    assert isinstance(end, End) and not any(isinstance(e, End) for e in got[:-1])
    assert [out.finish_reason for out in end.finals] == ["stop", "length"]
    assert end.output_tokens == 5


def test_keep_alives_flow_while_a_choice_is_slow() -> None:
    got = _all([_Stream([_out("a", 1), _out("b", 2, "stop")], delay=0.05)], keepalive=0.005)
    assert any(isinstance(e, KeepAlive) for e in got)
    assert isinstance(got[-1], End)


@pytest.mark.parametrize(
    ("finish", "status", "kind"), [("error", 500, "server_error"), ("abort", 503, "server_error")]
)
def test_the_engines_own_failure_ends_the_stream_typed_a_server_error(
    finish: str, status: int, kind: str
) -> None:
    failing = _Stream([_out("a", 1), _out("", 1, finish, error="device fault")])
    other = _Stream([_out("b", 1), _out("c", 2)], delay=0.2)
    got = _all([failing, other])
    failure = got[-1]
    assert isinstance(failure, Failure) and failure.engine_fault
    assert (failure.error.status, failure.error.code) == (status, finish)
    assert failure.error.message == "device fault"
    assert failure.output_tokens >= 1  # what was generated before it failed
    assert openai_error(failure)["error"] == {
        "message": "device fault",
        "type": kind,
        "param": None,
        "code": finish,
    }
    assert other.closed_early  # the other choice was aborted, not left running


def test_an_adapter_whose_files_changed_is_a_409_about_the_model_not_the_engine() -> None:
    out = _out("", 0, "error", error="adapter changed on disk", error_code=ADAPTER_CHANGED)
    (failure,) = _all([_Stream([out])])
    assert isinstance(failure, Failure) and not failure.engine_fault
    err = failure.error
    assert (err.status, err.param, err.code) == (409, "model", ADAPTER_CHANGED)


@pytest.mark.parametrize(
    ("cause", "status", "code", "kind"),
    [
        (RequestTimeoutError(2.0), 504, "request_timeout", "timeout_error"),
        (EngineBusyError("queue full"), 503, None, "service_unavailable"),
        (AdmissionError("too long", "messages"), 400, "context_length_exceeded", None),
        (APIError(400, "prompt grew past the context"), 400, None, None),
        (RuntimeError("bug"), 500, None, "server_error"),
    ],
)
def test_an_exception_while_generating_is_one_failure_with_its_status(
    cause: Exception, status: int, code: str | None, kind: str | None
) -> None:
    got = _all([_Stream([_out("a", 1), cause])])
    assert isinstance(got[0], Piece)
    failure = got[-1]
    assert isinstance(failure, Failure) and len(got) == 2
    assert (failure.error.status, failure.error.code) == (status, code)
    assert failure.error.type == (kind or "invalid_request_error")
    assert failure_of(cause).error.status == status  # the same mapping outside a stream


def test_a_choice_that_ends_without_any_output_is_a_failure_not_an_empty_reply() -> None:
    got = _all([_Stream([_out("a", 1, "stop")]), _Stream([])])
    failure = got[-1]
    assert isinstance(failure, Failure)
    assert failure.error.status == 500 and "no output" in failure.error.message


def test_closing_the_event_stream_early_aborts_every_engine_request() -> None:
    streams = [_Stream([_out(str(i), i + 1) for i in range(50)], delay=0.01) for _ in range(2)]

    async def first_few() -> list[bool]:
        stream = events(streams, keepalive=0.001)
        seen = 0
        async for event in stream:
            seen += isinstance(event, Piece)
            if seen == 3:
                break
        await stream.aclose()  # type: ignore[attr-defined]
        return [s.closed_early for s in streams]  # before the loop's own clean-up could

    assert asyncio.run(first_few()) == [True, True]
