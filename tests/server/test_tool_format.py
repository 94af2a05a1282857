"""How a request's tools and tool turns reach the template, on both APIs: as the template's
``tools`` variable and structured turns when the template takes tools, else as the generic block
and text in the model's syntax."""

from __future__ import annotations

from typing import Any

import pytest

from inferd.server.anthropic_tools import parse_anthropic_tools, turns
from inferd.server.errors import APIError
from inferd.server.openai_tools import (
    StreamedCalls,
    ToolRequest,
    history_turn,
    message,
    offer,
    parse_tools,
)
from inferd.server.responses_input import ResponsesRequest, tool_request
from inferd.structured.tool_syntax import ToolFormat, calls_constraint, syntax_named

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS: list[Any] = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]
IN_TEMPLATE = ToolFormat(syntax_named("mistral"), in_template=True)
GENERIC = ToolFormat(syntax_named("pythonic"), in_template=False)
ASK = [{"role": "user", "content": "Weather?"}]


def _text(block: dict[str, Any], where: str) -> str:
    return str(block["text"])


def test_a_template_that_takes_tools_gets_them_as_its_variable() -> None:
    request = parse_tools(TOOLS, "auto", None)
    messages, tools = offer(ASK, request, IN_TEMPLATE)
    assert messages == ASK
    assert tools == [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "", "parameters": PARAMS},
        }
    ]


def test_any_other_template_gets_the_block_in_the_models_syntax() -> None:
    request = parse_tools(TOOLS, "auto", None)
    messages, tools = offer(ASK, request, GENERIC)
    assert tools is None and messages[1:] == ASK
    assert messages[0]["role"] == "system" and "Python list of calls" in messages[0]["content"]
    assert offer(ASK, parse_tools(TOOLS, "none", None), GENERIC) == (ASK, None)


@pytest.mark.parametrize("fmt", [IN_TEMPLATE, GENERIC], ids=["template", "generic"])
def test_openai_tool_turns(fmt: ToolFormat) -> None:
    known: dict[str, str] = {}
    call = {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    turn = history_turn(1, "assistant", "", [call], None, known, fmt)
    result = history_turn(2, "tool", "sunny", None, "c1", known, fmt)
    if fmt.in_template:
        assert turn["tool_calls"] == [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
            }
        ]
        assert result == {
            "role": "tool",
            "tool_call_id": "c1",
            "name": "get_weather",
            "content": "sunny",
        }
    else:
        assert turn == {"role": "assistant", "content": '[get_weather(city="Rome")]'}
        assert result == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    with pytest.raises(APIError, match="no assistant tool call with id 'c9'"):
        history_turn(3, "tool", "x", None, "c9", known, fmt)


@pytest.mark.parametrize("fmt", [IN_TEMPLATE, GENERIC], ids=["template", "generic"])
def test_anthropic_tool_blocks(fmt: ToolFormat) -> None:
    known: dict[str, str] = {}
    use = [
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Rome"}},
    ]
    answer = [
        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "9C"}]},
        {"type": "text", "text": "And tomorrow?"},
    ]
    assistant = turns("assistant", use, "messages.1.content", known, fmt, _text)
    user = turns("user", answer, "messages.2.content", known, fmt, _text)
    if fmt.in_template:
        assert assistant == [
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [
                    {
                        "id": "t1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
                    }
                ],
            }
        ]
        assert user == [
            {"role": "tool", "tool_call_id": "t1", "name": "get_weather", "content": "9C"},
            {"role": "user", "content": "And tomorrow?"},
        ]
    else:
        assert assistant == [
            {"role": "assistant", "content": 'Checking.\n[get_weather(city="Rome")]'}
        ]
        assert user == [
            {"role": "user", "content": "<tool_response>\n9C\n</tool_response>And tomorrow?"}
        ]
    orphan = [{"type": "tool_result", "tool_use_id": "t7", "content": "x"}]
    with pytest.raises(APIError, match="no tool_use block with id 't7'"):
        turns("user", orphan, "messages.3.content", known, fmt, _text)


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    return {"type": "image", "at": where}


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}


@pytest.mark.parametrize("fmt", [IN_TEMPLATE, GENERIC], ids=["template", "generic"])
def test_anthropic_images_in_tool_results_and_beside_them(fmt: ToolFormat) -> None:
    known = {"t1": "get_weather"}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [IMAGE, TEXT_9C]}
    answer: list[dict[str, Any]] = [result, IMAGE, {"type": "text", "text": "And this?"}]
    user = turns("user", answer, "messages.2.content", known, fmt, _text, _image)
    first = {"type": "image", "at": "messages.2.content.0.content.0"}
    second = {"type": "image", "at": "messages.2.content.1"}
    if fmt.in_template:  # the tool turn's parts, then the rest of the message
        assert user == [
            {
                "role": "tool",
                "tool_call_id": "t1",
                "name": "get_weather",
                "content": [first, {"type": "text", "text": "9C"}],
            },
            {"role": "user", "content": [second, {"type": "text", "text": "And this?"}]},
        ]
    else:  # one user turn: the result wrapped as text, its image in place, then the rest
        assert user == [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<tool_response>\n"},
                    first,
                    {"type": "text", "text": "9C\n</tool_response>"},
                    second,
                    {"type": "text", "text": "And this?"},
                ],
            }
        ]
    # without an image reader (system prompts), an image block is the block reader's to refuse
    with pytest.raises(APIError, match="takes a string or text blocks"):
        turns("user", [result], "messages.2.content", known, fmt, _text)


TEXT_9C = {"type": "text", "text": "9C"}


def test_image_slots_follow_the_rendered_order() -> None:
    from inferd.server.anthropic_images import ImageSlots

    slots = ImageSlots()
    known = {"t1": "get_weather"}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [IMAGE]}
    # decoded order: the top-level image (0), then the tool result's (1); a template that
    # takes tool turns renders the tool result first
    messages = turns("user", [IMAGE, result], "m", known, IN_TEMPLATE, _text, slots.part)
    assert slots.in_rendered_order(messages, ["top", "in result"]) == ["in result", "top"]
    assert all(set(p) == {"type"} for m in messages for p in m["content"])  # numbers removed


# -- how many calls a request allows -----------------------------------------------------------

HERMES = ToolFormat(syntax_named("hermes"), in_template=False)
TWO_TOOLS: list[Any] = [
    *TOOLS,
    {"type": "function", "function": {"name": "get_time", "parameters": PARAMS}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
TWO_CALLS = HERMES.syntax.calls_text([("get_weather", '{"city": "Rome"}')] * 2)


def _one_call_grammar(request: ToolRequest) -> bool:
    """Whether the request's grammar is the one-call grammar of the tools it may call."""
    constraint = request.constraint(HERMES)
    one = calls_constraint(
        HERMES.syntax, request.callable, parallel=False, lazy=request.choice == "auto"
    )
    assert constraint is not None
    return constraint.source == one.source


def test_a_named_tool_or_parallel_calls_off_mean_one_call_on_every_api() -> None:
    """A named tool_choice is one call of it, parallel calls or not (what instructor's TOOLS
    mode and langchain's forced tool expect); parallel calls off, one call of any tool."""
    one = [
        parse_tools(TWO_TOOLS, NAMED, None),
        parse_tools(TWO_TOOLS, NAMED, True),
        parse_tools(TWO_TOOLS, "required", False),
        parse_tools(TWO_TOOLS, "auto", False),
        parse_anthropic_tools(
            [{"name": "get_weather", "input_schema": PARAMS}],
            {"type": "tool", "name": "get_weather"},
        ),
        parse_anthropic_tools(
            [{"name": "get_weather", "input_schema": PARAMS}],
            {"type": "any", "disable_parallel_tool_use": True},
        ),
        tool_request(
            ResponsesRequest(
                model="m",
                tools=[{"type": "function", "name": "get_weather", "parameters": PARAMS}],
                tool_choice={"type": "function", "name": "get_weather"},
            )
        ),
    ]
    for request in one:
        assert request is not None
        assert _one_call_grammar(request), request
    several = parse_tools(TWO_TOOLS, "required", None)
    assert several is not None and not _one_call_grammar(several)


def test_a_one_call_reply_holds_one_call_streamed_or_not() -> None:
    """Whatever the grammar let through, a named request's reply is one call, and its stream
    never puts a second call's arguments under the first call's index."""
    request = parse_tools(TWO_TOOLS, NAMED, None)
    assert request is not None
    content, calls = message(TWO_CALLS, request.reader(HERMES))
    assert content is None and [c["function"]["arguments"] for c in calls] == ['{"city": "Rome"}']
    stream = StreamedCalls(request.reader(HERMES))
    deltas = [d for ch in TWO_CALLS for d in stream.deltas(ch)] + list(stream.finish())
    entries = [e for d in deltas for e in d["tool_calls"]]
    assert {e["index"] for e in entries} == {0} and len(stream.ids) == 1
    assert "".join(e["function"]["arguments"] for e in entries) == '{"city": "Rome"}'


def test_parallel_calls_stream_each_under_its_own_index() -> None:
    request = parse_tools(TWO_TOOLS, "required", None)
    assert request is not None
    stream = StreamedCalls(request.reader(HERMES))
    entries = [e for ch in TWO_CALLS for d in stream.deltas(ch) for e in d["tool_calls"]]
    assert [e["index"] for e in entries if "id" in e] == [0, 1]
    for index in (0, 1):
        args = "".join(e["function"]["arguments"] for e in entries if e["index"] == index)
        assert args == '{"city": "Rome"}'


@pytest.mark.parametrize(
    ("choice", "needle"),
    [
        ({"type": {}}, "tool_choice.type must be"),
        ({"type": ["tool"]}, "tool_choice.type must be"),
        ({"type": "tool", "name": {}}, "not among the tools"),
    ],
)
def test_an_anthropic_tool_choice_of_the_wrong_shape_is_a_400(choice: Any, needle: str) -> None:
    tools = [{"name": "get_weather", "input_schema": PARAMS}]
    with pytest.raises(APIError, match=needle) as caught:
        parse_anthropic_tools(tools, choice)
    assert caught.value.status == 400


def test_strict_false_keeps_a_tools_objects_open_and_strict_must_be_a_boolean() -> None:
    fn = TOOLS[0]["function"]
    default, off = (
        parse_tools(TOOLS, "auto", None),
        parse_tools([{"type": "function", "function": fn | {"strict": False}}], "auto", None),
    )
    assert default is not None and off is not None
    assert default.tools[0].arguments_schema["additionalProperties"] is False
    assert off.tools[0].arguments_schema == PARAMS
    with pytest.raises(APIError, match="strict must be a boolean") as caught:
        parse_tools([{"type": "function", "function": fn | {"strict": "yes"}}], "auto", None)
    assert caught.value.param == "tools.0.function.strict"
