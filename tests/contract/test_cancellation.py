"""Typed cancellation outcomes and usage reconciliation (contract/stream.py, reconcile.py).

The server's side of each stream is the bytes inferd serve writes: its own ``stream_events``
(the chat stream's framing of an engine failure, a deadline or an abort, with the usage the
request asked for) and its own shutdown event, so the classification follows the server as it
is, not a copy of its error bodies. The live halves (a real server, a real cut) are in
test_live_gate.py (the caller) and tests/server/test_timeout_live.py (the scheduler)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Iterable
from typing import Any

import pytest

from inferd.contract.fixtures import INFERD_ROUTE, inferd_items, render
from inferd.contract.reconcile import ServerRecord, reconcile, server_record
from inferd.contract.stream import (
    CallerCancelled,
    Cancelled,
    Canceller,
    ConnectionDropped,
    Expectation,
    ProtocolError,
    Rule,
    SchedulerCancelled,
    ServerCancelled,
    StreamConsumer,
    Usage,
    UsageSource,
)
from inferd.server import sse
from inferd.server.envelope import stream_error_event
from inferd.server.generation import stream_events
from inferd.server.limits import RequestTimeoutError
from inferd.serving.interface import RequestOutput

EXPECT = Expectation(INFERD_ROUTE, 64, True)
ITEMS = inferd_items()  # role, six text deltas, stop, usage chunk, [DONE]
FIRST = ITEMS[0]
assert isinstance(FIRST, dict)
ENVELOPE = {k: v for k, v in FIRST.items() if k not in ("choices", "usage")}
PROMPT_TOKENS = 12


def _consumer(data: bytes) -> StreamConsumer:
    consumer = StreamConsumer(EXPECT)
    consumer.feed(data)
    return consumer


# -- the caller and the connection ---------------------------------------------------------------
def test_a_caller_that_cancels_before_any_chunk_knows_nothing_of_the_usage() -> None:
    outcome = StreamConsumer(EXPECT).cancel()
    assert isinstance(outcome, CallerCancelled) and outcome.by is Canceller.CALLER
    assert outcome.usage_source is UsageSource.UNKNOWN and outcome.completion_tokens is None
    assert not outcome.ok and outcome.kind == "cancelled_by_caller"


@pytest.mark.parametrize("deltas", [0, 1, 4])
def test_a_caller_that_cancels_mid_stream_counts_the_tokens_it_received(deltas: int) -> None:
    """The role chunk carries no token; each text delta after it is one decode step."""
    consumer = _consumer(render(ITEMS[: 1 + deltas]))
    outcome = consumer.cancel()
    assert isinstance(outcome, CallerCancelled)
    assert outcome.usage_source is UsageSource.RECEIVED
    assert outcome.completion_tokens == outcome.tokens_received == deltas
    assert outcome.partial_text == consumer.text and outcome.usage is None
    assert consumer.finish() is outcome  # a later end of bytes does not change the decision


def test_a_caller_that_cancels_after_the_usage_chunk_has_the_servers_figures() -> None:
    outcome = _consumer(render(ITEMS)).cancel()  # [DONE] arrived, end of bytes did not
    assert isinstance(outcome, CallerCancelled)
    assert outcome.usage == Usage(PROMPT_TOKENS, 6, PROMPT_TOKENS + 6)
    assert outcome.usage_source is UsageSource.SERVER and outcome.completion_tokens == 6


def test_a_dropped_connection_is_typed_with_its_cause_and_what_arrived() -> None:
    consumer = _consumer(render(ITEMS[:4]))
    outcome = consumer.transport_failed("RemoteProtocolError: peer closed connection")
    assert isinstance(outcome, ConnectionDropped) and outcome.by is Canceller.CONNECTION
    assert outcome.detail.startswith("RemoteProtocolError") and outcome.tokens_received == 3
    assert outcome.partial_text == "Café ✓ —"


def test_a_protocol_error_stays_one_when_the_caller_cancels_after_it() -> None:
    consumer = _consumer(render([*ITEMS[:2], "data: {broken"]))
    assert isinstance(consumer.cancel(), ProtocolError)
    assert consumer.outcome.rule is Rule.INVALID_JSON  # type: ignore[union-attr]


# -- the server and its scheduler, in inferd serve's own bytes -----------------------------------
class _Engine:
    """An engine stream: two one-token outputs, then ``cause`` (an exception or a final output)."""

    def __init__(self, cause: Exception | RequestOutput) -> None:
        self.cause = cause

    async def run(self) -> AsyncIterator[RequestOutput]:
        for n, text in enumerate(["Café", " ✓"], start=1):
            yield RequestOutput("r", text, (n,), None, PROMPT_TOKENS, n)
        if isinstance(self.cause, Exception):
            raise self.cause
        yield self.cause


def _served(cause: Exception | RequestOutput, include_usage: bool) -> bytes:
    """The chat stream inferd writes for that engine stream (its role chunk, its stream_events)."""

    def on_output(index: int, out: RequestOutput) -> Iterable[bytes]:
        choice = {"index": 0, "delta": {"content": out.text}, "finish_reason": None}
        yield sse.event(ENVELOPE | {"choices": [choice]})

    def usage(output_tokens: int) -> dict[str, Any]:
        total = PROMPT_TOKENS + output_tokens
        counts = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": output_tokens}
        return ENVELOPE | {"choices": [], "usage": counts | {"total_tokens": total}}

    async def body() -> bytes:
        frames = [render(ITEMS[:1])]
        with_usage = usage if include_usage else None
        async for frame in stream_events([_Engine(cause).run()], 60.0, on_output, with_usage):
            frames.append(frame)
        return b"".join(frames)

    return asyncio.run(body())


ABORT = RequestOutput("r", "", (), "abort", PROMPT_TOKENS, 2, error="the model was unloaded")
FAULT = RequestOutput("r", "", (), "error", PROMPT_TOKENS, 2, error="engine error: device fault")


@pytest.mark.parametrize(
    ("cause", "cut", "code"),
    [
        (RequestTimeoutError(4.0), SchedulerCancelled, "request_timeout"),
        (ABORT, SchedulerCancelled, "abort"),
        (FAULT, ServerCancelled, "error"),
        (RuntimeError("a bug"), ServerCancelled, None),
    ],
)
@pytest.mark.parametrize("include_usage", [True, False])
def test_an_error_event_is_typed_by_who_cut_the_run(
    cause: Exception | RequestOutput, cut: type[Cancelled], code: str | None, include_usage: bool
) -> None:
    data = _served(cause, include_usage)
    assert data.endswith(b"data: [DONE]\n\n")
    consumer = _consumer(data)
    outcome = consumer.finish()
    assert type(outcome) is cut and outcome.code == code, outcome
    assert outcome.partial_text == "Café ✓" and outcome.tokens_received == 2
    if include_usage:  # the server's own count of what it generated before the cut
        assert outcome.usage == Usage(PROMPT_TOKENS, 2, PROMPT_TOKENS + 2)
        assert outcome.usage_source is UsageSource.SERVER
    else:
        assert outcome.usage is None and outcome.usage_source is UsageSource.RECEIVED
    assert outcome.completion_tokens == 2


@pytest.mark.parametrize("include_usage", [True, False])
def test_a_shutdown_that_cuts_a_stream_is_the_servers_cancellation(include_usage: bool) -> None:
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    counted = Usage(PROMPT_TOKENS, 3, PROMPT_TOKENS + 3)  # one generated, not yet delivered
    usage = dataclasses.asdict(counted) if include_usage else None
    cut = stream_error_event(
        scope, "the server is shutting down", "server_shutting_down", 503, usage=usage
    )
    outcome = _consumer(render(ITEMS[:3]) + cut).finish()
    assert isinstance(outcome, ServerCancelled) and outcome.code == "server_shutting_down"
    assert outcome.tokens_received == 2 and "shutting down" in outcome.detail
    if include_usage:
        assert outcome.usage == counted and outcome.usage_source is UsageSource.SERVER
    else:
        assert outcome.usage_source is UsageSource.RECEIVED and outcome.completion_tokens == 2


def test_usage_on_an_error_event_is_checked_like_any_usage() -> None:
    event = {"error": {"message": "late", "code": "request_timeout"}, "usage": {"prompt_tokens": 1}}
    outcome = _consumer(render([*ITEMS[:2], event])).finish()
    assert isinstance(outcome, ProtocolError) and outcome.rule is Rule.USAGE_INVALID


# -- reconciliation against the server's record ---------------------------------------------------
def _record(outcome: str, completion: int | None, error: str | None = None) -> ServerRecord:
    return ServerRecord("req-1", 200, outcome, error, PROMPT_TOKENS, completion)


def test_tokens_in_flight_at_a_cancel_are_undelivered_not_lost() -> None:
    outcome = _consumer(render(ITEMS[:4])).cancel()  # three tokens received
    got = reconcile(outcome, _record("client_disconnected", 5), max_tokens=64)
    assert got.consistent, got.problems
    assert (got.client_tokens, got.server_tokens, got.undelivered) == (3, 5, 2)
    assert got.billed_tokens == 5 and got.source is UsageSource.RECEIVED


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        (_record("client_disconnected", 2), "3 tokens arrived, but the server recorded only 2"),
        (_record("client_disconnected", 65), "over max_tokens 64"),
        (_record("error", 5, "timeout"), "cut by the caller, but the server recorded error"),
        (None, "kept no record"),
    ],
)
def test_a_record_that_cannot_match_the_client_is_reported(
    record: ServerRecord | None, problem: str
) -> None:
    outcome = _consumer(render(ITEMS[:4])).cancel()
    got = reconcile(outcome, record, max_tokens=64)
    assert not got.consistent and any(problem in p for p in got.problems), got.problems


def test_the_servers_figures_on_the_stream_must_equal_its_record() -> None:
    outcome = _consumer(_served(RequestTimeoutError(4.0), include_usage=True)).finish()
    assert isinstance(outcome, SchedulerCancelled)
    same = reconcile(outcome, _record("error", 2, "timeout"), max_tokens=64)
    assert same.consistent and same.undelivered == 0 and same.source is UsageSource.SERVER
    other = reconcile(outcome, _record("error", 3, "timeout"), max_tokens=64)
    assert other.problems == ("the stream's usage says 2 tokens, the record 3",)
    shutdown = reconcile(outcome, _record("error", 2, "shutdown"), max_tokens=64)
    assert not shutdown.consistent  # a shutdown is the server's cut, not the scheduler's


def test_server_record_reads_the_json_access_log_end_line() -> None:
    end = {"ts": "t", "event": "request_end", "request_id": "req-1", "status": 200}
    end |= {"prompt_tokens": 12, "completion_tokens": 7, "outcome": "client_disconnected"}
    start = {"ts": "t", "event": "request_start", "request_id": "req-1"}
    log = "\n".join(["INFO: started", json.dumps(start), json.dumps(end), "{not json"])
    assert server_record(log, "req-1") == _record("client_disconnected", 7)
    assert server_record(log, "req-2") is None
