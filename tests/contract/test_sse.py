"""The incremental SSE decoder, and split-invariance of the whole consumer (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.contract.fixtures import (
    EXAMPLE_ROUTE,
    INFERD_ROUTE,
    example_items,
    inferd_items,
    render,
)
from inferd.contract.sse import (
    DecodeFailure,
    DecodeLimits,
    DecodeRule,
    SseComment,
    SseDecoder,
    SseEvent,
    SseItem,
)
from inferd.contract.stream import Complete, Expectation, ProtocolError, Rule, StreamLimits
from tests.contract.helpers import consume, split_at


def _decode(
    pieces: list[bytes], limits: DecodeLimits | None = None
) -> tuple[list[SseItem], DecodeFailure | None]:
    decoder = SseDecoder(limits)
    items: list[SseItem] = []
    for piece in pieces:
        items += decoder.feed(piece)
    return items, decoder.error


def test_fields_comments_and_multiline_data() -> None:
    raw = b": hello\ndata: a\ndata:b\ndata\nid: 7\nretry: 10\nfoo: bar\n\n"
    items, error = _decode([raw])
    assert error is None
    assert items == [SseComment("hello"), SseEvent("message", "a\nb\n")]


def test_line_endings_are_equivalent() -> None:
    lf = b"data: x\n\n: c\n\ndata: [DONE]\n\n"
    for eol in (b"\r\n", b"\r"):
        assert _decode([lf.replace(b"\n", eol)]) == _decode([lf])


def test_cr_then_lf_across_reads_is_one_line_end() -> None:
    items, error = _decode([b"data: x\r", b"\ndata: y\r", b"\n\r", b"\n"])
    assert error is None and items == [SseEvent("message", "x\ny")]


def test_utf8_split_across_reads() -> None:
    raw = "data: naïve 😀\n\n".encode()
    cut = raw.index("😀".encode()) + 2
    assert _decode([raw[:cut], raw[cut:]])[0] == [SseEvent("message", "naïve 😀")]


def test_leading_bom_is_ignored_once() -> None:
    items, _ = _decode([b"\xef\xbb", b"\xbfdata: x\n\n"])
    assert items == [SseEvent("message", "x")]


def test_blank_blocks_dispatch_nothing_but_named_empty_events_do() -> None:
    items, _ = _decode([b"\n\n\nid: 3\n\nevent: approval\n\n"])
    assert items == [SseEvent("approval", "")]


@pytest.mark.parametrize(
    ("pieces", "limits", "rule"),
    [
        (
            [b"data: " + b"x" * 100 + b"\n\n"],
            DecodeLimits(max_line_bytes=50),
            DecodeRule.LINE_TOO_LONG,
        ),
        ([b"data: " + b"x" * 100], DecodeLimits(max_line_bytes=50), DecodeRule.LINE_TOO_LONG),
        (
            [b"data: 123456\n" * 10 + b"\n"],
            DecodeLimits(max_event_bytes=40),
            DecodeRule.EVENT_TOO_LARGE,
        ),
        ([b"data: \xff\n\n"], None, DecodeRule.INVALID_UTF8),
        ([b"data: x\n\n" * 3], DecodeLimits(max_wire_bytes=20), DecodeRule.WIRE_BYTES),
        ([b": k\n\n" * 4], DecodeLimits(max_items=3), DecodeRule.EVENT_COUNT),
        ([b"data: [DONE]\n\n", b"\n"], None, DecodeRule.BYTES_AFTER_DONE),
        ([b"data: [DONE]\n\ndata: [DONE]\n\n"], None, DecodeRule.BYTES_AFTER_DONE),
    ],
)
def test_decoder_bounds(pieces: list[bytes], limits: DecodeLimits | None, rule: DecodeRule) -> None:
    _, error = _decode(pieces, limits)
    assert error is not None and error.rule is rule


def test_crlf_after_done_is_not_trailing() -> None:
    assert _decode([b"data: [DONE]\r\n\r", b"\n"])[1] is None


def test_items_before_a_failure_are_still_delivered() -> None:
    items, error = _decode([b"data: a\n\ndata: \xff\n\n"])
    assert items == [SseEvent("message", "a")] and error is not None


# -- split invariance of the full consumer --------------------------------------------------------
EXAMPLE = Expectation(EXAMPLE_ROUTE, 64, True)
INFERD = Expectation(INFERD_ROUTE, 16, True)
_example = render(example_items())
_inferd = render(inferd_items())
_utf8_cut = _inferd.index("😀".encode()) + 2

# name -> (bytes, expectation, limits, expected outcome kind or rule)
CASES: dict[str, tuple[bytes, Expectation, StreamLimits | None, str]] = {
    "example-lf": (_example, EXAMPLE, None, "complete"),
    "example-crlf": (render(example_items(), "\r\n"), EXAMPLE, None, "complete"),
    "example-cr": (render(example_items(), "\r"), EXAMPLE, None, "complete"),
    "inferd-lf": (_inferd, INFERD, None, "complete"),
    "inferd-crlf": (render(inferd_items(), "\r\n"), INFERD, None, "complete"),
    "inferd-length": (
        render(inferd_items("length", 16)),
        INFERD,
        None,
        "incomplete_length_limited",
    ),
    "truncated-in-done": (_example[:-5], EXAMPLE, None, Rule.DONE_MISSING),
    "truncated-mid-utf8": (_inferd[:_utf8_cut], INFERD, None, Rule.UNEXPECTED_EOF),
    "invalid-utf8": (
        _inferd.replace("😀".encode(), b"\xf0\x9f\xff\x80"),
        INFERD,
        None,
        Rule.INVALID_UTF8,
    ),
    "trailing-bytes": (_example + b": late\n\n", EXAMPLE, None, Rule.BYTES_AFTER_DONE),
    "line-bound": (_example, EXAMPLE, StreamLimits(max_line_bytes=200), Rule.LINE_TOO_LONG),
    "wire-bound": (_example, EXAMPLE, StreamLimits(max_wire_bytes=1500), Rule.WIRE_BYTES),
    "event-bound": (_example, EXAMPLE, StreamLimits(max_events=5), Rule.EVENT_COUNT),
    "text-bound": (_inferd, INFERD, StreamLimits(max_text_bytes=12), Rule.TEXT_BOUND),
}
WHOLE = {name: consume([data], expect, limits) for name, (data, expect, limits, _) in CASES.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_whole_buffer_outcome(name: str) -> None:
    expected = CASES[name][3]
    outcome = WHOLE[name][0]
    if isinstance(expected, Rule):
        assert isinstance(outcome, ProtocolError) and outcome.rule is expected, outcome
    else:
        assert outcome.kind == expected, outcome
    if expected == "complete":
        assert isinstance(outcome, Complete)


@pytest.mark.parametrize("name", list(CASES))
def test_every_split_point_gives_the_same_result(name: str) -> None:
    data, expect, limits, _ = CASES[name]
    for cut in range(1, len(data)):
        assert consume(split_at(data, [cut]), expect, limits) == WHOLE[name], cut


@pytest.mark.parametrize("name", list(CASES))
def test_one_byte_at_a_time_gives_the_same_result(name: str) -> None:
    data, expect, limits, _ = CASES[name]
    pieces = [data[i : i + 1] for i in range(len(data))]
    assert consume(pieces, expect, limits) == WHOLE[name]


@pytest.mark.parametrize("name", list(CASES))
@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(min_value=1, max_value=1 << 20), max_size=64))
def test_random_partitions_give_the_same_result(name: str, cuts: list[int]) -> None:
    data, expect, limits, _ = CASES[name]
    pieces = split_at(data, [c % len(data) or 1 for c in cuts])
    assert consume(pieces, expect, limits) == WHOLE[name]
