"""One test per rule of the strict stream contract, each mutating a valid fixture."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from inferd.contract.fixtures import (
    EXAMPLE_ROUTE,
    EXAMPLE_TEXT,
    INFERD_ROUTE,
    Item,
    example_items,
    inferd_items,
    render,
)
from inferd.contract.stream import (
    CallerCancelled,
    Complete,
    ConnectionDropped,
    ContentFiltered,
    Expectation,
    IncompleteLengthLimited,
    OutcomeKind,
    ProtocolError,
    Rule,
    StreamConsumer,
    StreamLimits,
    ToolCallsRequested,
    Usage,
    check_head,
    error_body_summary,
)
from tests.contract.helpers import consume

EXPECT = Expectation(EXAMPLE_ROUTE, 64, True)
# example_items(): 0 keep-alive, 1 role, 2-5 text, 6 keep-alive, 7-9 text, 10 stop+usage, 11 [DONE]
ROLE, TEXT, TEXT2, TERMINAL, DONE = 1, 2, 3, 10, 11


def _chunk(items: list[Item], i: int) -> dict[str, Any]:
    item = items[i]
    assert isinstance(item, dict)
    return item


def _mutated(mutate: Callable[[list[Item]], None]) -> bytes:
    items = copy.deepcopy(example_items())
    mutate(items)
    return render(items)


@dataclass(frozen=True)
class Case:
    rule: Rule
    mutate: Callable[[list[Item]], None] = lambda items: None
    limits: StreamLimits | None = None
    expect: Expectation = EXPECT
    wire: Callable[[bytes], bytes] = lambda data: data
    extra: dict[str, Any] = field(default_factory=dict)


def _set(i: int, path: tuple[Any, ...], value: Any) -> Callable[[list[Item]], None]:
    def mutate(items: list[Item]) -> None:
        target: Any = _chunk(items, i)
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return mutate


def _insert(i: int, item: Item) -> Callable[[list[Item]], None]:
    return lambda items: items.insert(i, item)


def _delete(*indexes: int) -> Callable[[list[Item]], None]:
    def mutate(items: list[Item]) -> None:
        for i in sorted(indexes, reverse=True):
            del items[i]

    return mutate


def _second_choice(items: list[Item]) -> None:
    chunk = _chunk(items, TEXT)
    chunk["choices"].append(dict(chunk["choices"][0], index=1))


def _second_role(items: list[Item]) -> None:
    _chunk(items, TEXT)["choices"][0]["delta"]["role"] = "assistant"


def _text_after_terminal(items: list[Item]) -> None:
    items.insert(DONE, copy.deepcopy(_chunk(items, TEXT)))


def _second_terminal(items: list[Item]) -> None:
    items.insert(DONE, copy.deepcopy(_chunk(items, TERMINAL)))


def _drop_usage(items: list[Item]) -> None:
    _chunk(items, TERMINAL)["usage"] = None


def _all_ids(value: str) -> Callable[[list[Item]], None]:
    def mutate(items: list[Item]) -> None:
        for item in items:
            if isinstance(item, dict):
                item["id"] = value

    return mutate


_USAGE = ("usage",)
CASES: dict[str, Case] = {
    # framing
    "line_too_long": Case(
        Rule.LINE_TOO_LONG, _set(TEXT, ("choices", 0, "delta", "content"), "x" * 70_000)
    ),
    "event_too_large": Case(Rule.EVENT_TOO_LARGE, limits=StreamLimits(max_event_bytes=200)),
    "invalid_utf8": Case(Rule.INVALID_UTF8, wire=lambda d: d.replace(b"Evidence", b"Evid\xffnce")),
    "wire_bytes": Case(Rule.WIRE_BYTES, limits=StreamLimits(max_wire_bytes=2000)),
    "event_count": Case(Rule.EVENT_COUNT, limits=StreamLimits(max_events=6)),
    "bytes_after_done": Case(Rule.BYTES_AFTER_DONE, lambda items: items.append(": late")),
    "second_done": Case(Rule.BYTES_AFTER_DONE, lambda items: items.append("data: [DONE]")),
    # events and chunks
    "named_event": Case(
        Rule.NAMED_EVENT, _insert(TERMINAL, 'event: tool_approval\ndata: {"tool":"shell"}')
    ),
    "named_event_no_data": Case(Rule.NAMED_EVENT, _insert(TEXT, "event: progress")),
    "invalid_json": Case(Rule.INVALID_JSON, _insert(TEXT, "data: {not json")),
    "duplicate_key": Case(Rule.INVALID_JSON, _insert(TEXT, 'data: {"id":"a","id":"b"}')),
    "nan": Case(Rule.INVALID_JSON, _set(TEXT, ("created",), float("nan"))),
    "wrong_object": Case(Rule.NOT_A_CHUNK, _set(TEXT, ("object",), "chat.completion")),
    "not_an_object": Case(Rule.NOT_A_CHUNK, _insert(TEXT, "data: [1, 2]")),
    "created_not_int": Case(Rule.NOT_A_CHUNK, _set(ROLE, ("created",), "now")),
    "delta_missing": Case(Rule.NOT_A_CHUNK, _set(TEXT, ("choices", 0, "delta"), None)),
    "response_id": Case(Rule.RESPONSE_ID, _all_ids("id with spaces")),
    "response_id_long": Case(Rule.RESPONSE_ID, _all_ids("x" * 129)),
    "response_id_drift": Case(Rule.RESPONSE_ID_DRIFT, _set(TEXT2, ("id",), "chatcmpl-other")),
    "created_drift": Case(Rule.CREATED_DRIFT, _set(TEXT2, ("created",), 1767225601)),
    "model_route": Case(Rule.MODEL_ROUTE, _set(TEXT2, ("model",), "default")),
    "model_route_first": Case(Rule.MODEL_ROUTE, expect=Expectation("/srv/other", 64, True)),
    "choice_count": Case(Rule.CHOICE_COUNT, _second_choice),
    "choice_count_zero": Case(Rule.CHOICE_COUNT, _set(TEXT, ("choices",), [])),
    "choice_index": Case(Rule.CHOICE_INDEX, _set(TEXT, ("choices", 0, "index"), 1)),
    "role_repeated": Case(Rule.ROLE, _second_role),
    "role_wrong": Case(Rule.ROLE, _set(ROLE, ("choices", 0, "delta", "role"), "user")),
    "text_nul": Case(Rule.TEXT, _set(TEXT, ("choices", 0, "delta", "content"), "a\x00b")),
    "text_type": Case(Rule.TEXT, _set(TEXT, ("choices", 0, "delta", "content"), 42)),
    "text_bound": Case(Rule.TEXT_BOUND, limits=StreamLimits(max_text_bytes=20)),
    "usage_early": Case(Rule.USAGE_BEFORE_TERMINAL, _set(TEXT, _USAGE, {"prompt_tokens": 1})),
    "usage_only_chunk_early": Case(
        Rule.USAGE_BEFORE_TERMINAL,
        _set(TEXT, ("choices",), []),
        extra={
            "also": _set(
                TEXT, _USAGE, {"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 1}
            )
        },
    ),
    "unknown_finish": Case(
        Rule.UNKNOWN_FINISH_REASON, _set(TERMINAL, ("choices", 0, "finish_reason"), "eos")
    ),
    "legacy_finish": Case(
        Rule.UNKNOWN_FINISH_REASON, _set(TERMINAL, ("choices", 0, "finish_reason"), "function_call")
    ),
    "text_after_terminal": Case(Rule.CHUNK_AFTER_TERMINAL, _text_after_terminal),
    "second_terminal": Case(Rule.CHUNK_AFTER_TERMINAL, _second_terminal),
    "usage_invalid": Case(Rule.USAGE_INVALID, _set(TERMINAL, ("usage", "prompt_tokens"), "128")),
    "usage_negative": Case(Rule.USAGE_INVALID, _set(TERMINAL, ("usage", "prompt_tokens"), -1)),
    "usage_arithmetic": Case(Rule.USAGE_ARITHMETIC, _set(TERMINAL, ("usage", "total_tokens"), 138)),
    "usage_over_max": Case(Rule.USAGE_OVER_MAX, expect=Expectation(EXAMPLE_ROUTE, 8, True)),
    "usage_missing": Case(Rule.USAGE_MISSING, _drop_usage),
    "terminal_missing": Case(Rule.TERMINAL_MISSING, _delete(TERMINAL)),
    "done_only": Case(Rule.TERMINAL_MISSING, _delete(*range(0, DONE))),
    "done_missing": Case(Rule.DONE_MISSING, _delete(DONE)),
    "unexpected_eof": Case(Rule.UNEXPECTED_EOF, _delete(*range(TEXT2 + 1, DONE + 1))),
    "empty_body": Case(Rule.UNEXPECTED_EOF, wire=lambda d: b""),
    "no_blank_line_after_done": Case(Rule.DONE_MISSING, wire=lambda d: d[:-1]),
}


def _bytes(case: Case) -> bytes:
    def mutate(items: list[Item]) -> None:
        case.mutate(items)
        if "also" in case.extra:
            case.extra["also"](items)

    return case.wire(_mutated(mutate))


@pytest.mark.parametrize("name", list(CASES))
def test_rule(name: str) -> None:
    case = CASES[name]
    outcome = consume([_bytes(case)], case.expect, case.limits)[0]
    assert isinstance(outcome, ProtocolError), outcome
    assert outcome.rule is case.rule, outcome
    assert not outcome.ok


def test_the_unmutated_fixture_is_complete() -> None:
    outcome = consume([render(example_items())], EXPECT)[0]
    assert outcome == Complete(
        EXAMPLE_TEXT, Usage(128, 9, 137), "chatcmpl-8d1c6e0f4b2a4c77", 1767225600, EXAMPLE_ROUTE
    )
    assert outcome.ok and outcome.finish_reason == "stop"


def test_partial_text_is_kept_on_failure() -> None:
    outcome = consume([_bytes(CASES["unexpected_eof"])], EXPECT)[0]
    assert isinstance(outcome, ProtocolError) and outcome.partial_text == "Evidence spans"


# -- rules outside the body: time, transport, and the response head ------------------------------
def test_idle_timeout() -> None:
    data = render(example_items())
    consumer = StreamConsumer(EXPECT, StreamLimits(idle_timeout_s=5), started_at=0.0)
    consumer.feed(data[:100], at=1.0)
    consumer.feed(data[100:], at=7.0)
    outcome = consumer.finish(at=7.0)
    assert isinstance(outcome, ProtocolError) and outcome.rule is Rule.IDLE_TIMEOUT


def test_idle_timeout_counts_the_wait_for_the_first_byte() -> None:
    consumer = StreamConsumer(EXPECT, StreamLimits(idle_timeout_s=5), started_at=0.0)
    consumer.feed(render(example_items()), at=6.0)
    assert consumer.finish().rule is Rule.IDLE_TIMEOUT  # type: ignore[union-attr]


def test_transport_reported_idle_timeout() -> None:
    consumer = StreamConsumer(EXPECT)
    consumer.feed(render(example_items())[:300])
    assert consumer.timed_out().rule is Rule.IDLE_TIMEOUT  # type: ignore[union-attr]


def test_total_timeout() -> None:
    data = render(example_items())
    consumer = StreamConsumer(
        EXPECT, StreamLimits(idle_timeout_s=5, total_timeout_s=10), started_at=0.0
    )
    for i in range(0, len(data), 200):
        consumer.feed(data[i : i + 200], at=float(i // 200) * 2)
    outcome = consumer.finish()
    assert isinstance(outcome, ProtocolError) and outcome.rule is Rule.TOTAL_TIMEOUT


def test_transport_failure_after_done_is_not_complete() -> None:
    consumer = StreamConsumer(EXPECT)
    consumer.feed(render(example_items()))
    outcome = consumer.transport_failed("connection reset")
    assert outcome == ConnectionDropped(EXAMPLE_TEXT, Usage(128, 9, 137), 7, "connection reset")
    assert not outcome.ok


def test_cancel_keeps_partial_text_and_is_not_success() -> None:
    consumer = StreamConsumer(EXPECT)
    consumer.feed(_bytes(CASES["unexpected_eof"]))
    outcome = consumer.cancel()
    assert outcome == CallerCancelled("Evidence spans", None, 2) and not outcome.ok
    assert consumer.finish() == outcome  # a later EOF does not change the decision


HEADERS = [("content-type", "text/event-stream; charset=utf-8"), ("x-request-id", "req-1")]


@pytest.mark.parametrize(
    ("status", "headers", "rule"),
    [
        (500, HEADERS, Rule.HTTP_STATUS),
        (404, HEADERS, Rule.HTTP_STATUS),
        (200, [("content-type", "application/json"), ("x-request-id", "req-1")], Rule.CONTENT_TYPE),
        (200, [("x-request-id", "req-1")], Rule.CONTENT_TYPE),
        (200, [*HEADERS, ("content-type", "text/event-stream")], Rule.CONTENT_TYPE),
        (200, HEADERS[:1], Rule.REQUEST_ID_ECHO),
        (200, [HEADERS[0], ("x-request-id", "req-2")], Rule.REQUEST_ID_ECHO),
        (200, [*HEADERS, ("x-request-id", "req-1")], Rule.REQUEST_ID_ECHO),
        (200, HEADERS + [("x-pad", "y")] * 64, Rule.HEADERS_BOUND),
        (200, [*HEADERS, ("x-pad", "y" * 20_000)], Rule.HEADERS_BOUND),
    ],
)
def test_head_rules(status: int, headers: list[tuple[str, str]], rule: Rule) -> None:
    broken = check_head(status, headers, "req-1", StreamLimits())
    assert broken is not None and broken[0] is rule


def test_good_head_passes() -> None:
    assert check_head(200, HEADERS, "req-1", StreamLimits()) is None


def test_error_bodies_are_sanitized() -> None:
    body = (
        b'{"error":{"message":"cannot read file:///srv/evidence/abc.png\\n\\u0000 for you",'
        b'"type":"invalid_request_error","code":null}}'
    )
    summary = error_body_summary(body)
    assert "file://" not in summary and "abc.png" not in summary and "\x00" not in summary
    assert "invalid_request_error" in summary and "<url>" in summary
    assert len(error_body_summary(b"x" * 10_000)) <= 200


def test_every_rule_has_a_test() -> None:
    tested = {c.rule for c in CASES.values()}
    tested |= {Rule.IDLE_TIMEOUT, Rule.TOTAL_TIMEOUT}
    tested |= {Rule.HTTP_STATUS, Rule.CONTENT_TYPE, Rule.REQUEST_ID_ECHO, Rule.HEADERS_BOUND}
    tested |= {Rule.TOOL_CALL}  # test_a_broken_tool_call_stream_is_a_protocol_error
    assert tested == set(Rule)


# -- the typed non-success outcomes ----------------------------------------------------------------
INFERD = Expectation(INFERD_ROUTE, 16, True)


def test_length_limited_keeps_text_and_usage() -> None:
    outcome = consume([render(inferd_items("length", 16))], INFERD)[0]
    assert isinstance(outcome, IncompleteLengthLimited) and not outcome.ok
    assert outcome.usage == Usage(12, 16, 28) and outcome.text.startswith("Café")
    assert outcome.kind is OutcomeKind.LENGTH_LIMITED


def test_content_filter_is_its_own_outcome() -> None:
    outcome = consume([render(inferd_items("content_filter"))], INFERD)[0]
    assert isinstance(outcome, ContentFiltered) and not outcome.ok


def test_tool_calls_are_their_own_outcome() -> None:
    items = inferd_items("tool_calls")
    call = {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": "{}"},
    }
    _chunk(items, 6)["choices"][0]["delta"]["tool_calls"] = [call]
    outcome = consume([render(items)], INFERD)[0]
    assert isinstance(outcome, ToolCallsRequested) and not outcome.ok
    assert len(outcome.tool_calls) == 1 and '"name":"f"' in outcome.tool_calls[0]


def _streamed_calls(*deltas: dict[str, Any], finish: str = "tool_calls") -> Any:
    """An inferd stream whose text deltas are replaced by these tool_calls entries."""
    items = inferd_items(finish)
    for i, delta in enumerate(deltas, start=1):
        _chunk(items, i)["choices"][0]["delta"] = {"tool_calls": [delta]}
    for i in range(len(deltas) + 1, 7):
        _chunk(items, i)["choices"][0]["delta"] = {}
    return consume([render(items)], INFERD)[0]


def _opens(index: int, name: str, arguments: str = "") -> dict[str, Any]:
    function = {"name": name, "arguments": arguments}
    return {"index": index, "id": f"call_{index}", "type": "function", "function": function}


def _more(index: int, arguments: str) -> dict[str, Any]:
    return {"index": index, "function": {"arguments": arguments}}


def test_streamed_tool_calls_are_assembled_with_parsed_arguments() -> None:
    outcome = _streamed_calls(
        _opens(0, "get_weather", '{"ci'),
        _more(0, 'ty": "Paris"}'),
        _opens(1, "get_time"),
        _more(1, '{"zone": "CET"}'),
    )
    assert isinstance(outcome, ToolCallsRequested), outcome
    assert [(c.index, c.id, c.name, c.arguments) for c in outcome.calls] == [
        (0, "call_0", "get_weather", {"city": "Paris"}),
        (1, "call_1", "get_time", {"zone": "CET"}),
    ]


@pytest.mark.parametrize(
    ("deltas", "detail"),
    [
        # issue 31's defect: a second call's arguments appended to the same index
        ((_opens(0, "City", '{"name": "a"}'), _more(0, '{"name": "b"}')), "not JSON"),
        ((_opens(1, "f", "{}"),), "call 1 before call 0"),
        ((_opens(0, "f", "{}"), _opens(0, "g", "{}")), "named once already"),
        (({"index": 0, "type": "function", "function": {"name": "f"}},), "without an id"),
        ((_opens(0, "bad name!", "{}"),), "valid function name"),
        ((_opens(0, "f", "[1, 2]"),), "must be a JSON object"),
        ((_opens(0, "f", '{"a": 1, "a": 2}'),), "not JSON"),
        ((_opens(0, "f", '{"a": NaN}'),), "not JSON"),
        (({**_opens(0, "f"), "function": {"name": "f", "arguments": 3}},), "must be a string"),
    ],
)
def test_a_broken_tool_call_stream_is_a_protocol_error(
    deltas: tuple[dict[str, Any], ...], detail: str
) -> None:
    outcome = _streamed_calls(*deltas)
    assert isinstance(outcome, ProtocolError) and outcome.rule is Rule.TOOL_CALL, outcome
    assert detail in outcome.detail


def test_tool_calls_must_end_with_their_own_finish_reason() -> None:
    outcome = _streamed_calls(_opens(0, "f", "{}"), finish="stop")
    assert isinstance(outcome, ProtocolError) and outcome.rule is Rule.TOOL_CALL
    # cut at the token cap, a half-written call is an incomplete answer, not a call
    cut = _streamed_calls(_opens(0, "f", '{"a'), finish="length")
    assert isinstance(cut, IncompleteLengthLimited)


def test_usage_may_be_omitted_when_not_requested() -> None:
    items = inferd_items()
    del items[-2]
    for item in items:
        if isinstance(item, dict):
            item.pop("usage", None)
    outcome = consume([render(items)], Expectation(INFERD_ROUTE, 16, False))[0]
    assert isinstance(outcome, Complete) and outcome.usage is None
