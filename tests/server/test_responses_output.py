"""Output items and stream events of /v1/responses from a model's text
(server/responses_output.py): the same items whether the text comes whole or a character at a
time, and events that open, fill and close each item in order."""

from __future__ import annotations

import json
from typing import Any

import pytest

from inferd.server.responses_input import chat_messages, input_items
from inferd.server.responses_output import OutputBuilder, output_text
from inferd.structured.tool_syntax import ToolFormat
from inferd.structured.tool_syntax.hermes import call_text

CALLS = (
    "Let me check.\n"
    + call_text("get_weather", '{"city": "Paris"}')
    + "\n"
    + call_text("get_time", '{"zone": "CET"}')
)


def _run(text: str, pieces: list[str], calls: bool, complete: bool = True) -> tuple[Any, Any]:
    builder = OutputBuilder(ToolFormat().reader([]) if calls else None)
    events = [e for piece in pieces for e in builder.feed(piece)]
    events += builder.finish(complete)
    assert "".join(pieces) == text
    return builder, events


def _shape(items: list[dict[str, Any]]) -> list[Any]:
    """Items less their generated ids."""
    return [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]


@pytest.mark.parametrize("text", ["Hello there.", CALLS, "  \n", ""])
def test_whole_or_in_pieces_gives_the_same_items(text: str) -> None:
    whole, _ = _run(text, [text], calls=True)
    pieces, events = _run(text, list(text), calls=True)
    assert _shape(whole.items) == _shape(pieces.items)
    # the done events carry the final items
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == pieces.items


def test_prose_then_calls() -> None:
    builder, events = _run(CALLS, list(CALLS), calls=True)
    kinds = [i["type"] for i in builder.items]
    assert kinds == ["message", "function_call", "function_call"]
    assert output_text(builder.items) == "Let me check.\n"
    assert [json.loads(i["arguments"]) for i in builder.items[1:]] == [
        {"city": "Paris"},
        {"zone": "CET"},
    ]
    for index, item in enumerate(builder.items[1:], start=1):
        deltas = "".join(
            e["delta"]
            for e in events
            if e["type"] == "response.function_call_arguments.delta" and e["output_index"] == index
        )
        assert deltas == item["arguments"]
    # every item is added, then closed, before the next one opens
    marks = [
        (e["type"], e["output_index"])
        for e in events
        if e["type"] in ("response.output_item.added", "response.output_item.done")
    ]
    added, done = "response.output_item.added", "response.output_item.done"
    assert marks == [(added, 0), (done, 0), (added, 1), (done, 1), (added, 2), (done, 2)]


def test_without_tools_a_tool_tag_is_just_text() -> None:
    builder, _ = _run(CALLS, [CALLS], calls=False)
    assert [i["type"] for i in builder.items] == ["message"]
    assert output_text(builder.items) == CALLS


def test_a_cut_reply_is_incomplete() -> None:
    cut = CALLS[: CALLS.index("Paris")]
    builder, _ = _run(cut, [cut], calls=True, complete=False)
    assert builder.items[-1]["type"] == "function_call"
    assert builder.items[-1]["status"] == "incomplete"


def test_an_output_read_back_renders_as_the_chat_history() -> None:
    """Output items sent back as input render the same assistant turn chat's tool_calls do."""
    builder, _ = _run(CALLS, [CALLS], calls=True)
    known: set[str] = set()
    items = input_items([*builder.items], known)
    results = [
        {"type": "function_call_output", "call_id": i["call_id"], "output": "ok"}
        for i in builder.items
        if i["type"] == "function_call"
    ]
    items += input_items(results, known)
    messages = chat_messages("Be brief.", items, ToolFormat())
    assert [m["role"] for m in messages] == ["system", "assistant", "user", "user"]
    assert messages[1]["content"].startswith("Let me check.")
    assert messages[1]["content"].count("<tool_call>") == 2
    assert messages[2]["content"] == "<tool_response>\nok\n</tool_response>"
