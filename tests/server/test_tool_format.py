"""How a request's tools and tool turns reach the template, on both APIs: as the template's
``tools`` variable and structured turns when the template takes tools, else as the generic block
and text in the model's syntax."""

from __future__ import annotations

from typing import Any

import pytest

from inferd.server.anthropic_tools import turns
from inferd.server.errors import APIError
from inferd.server.openai_tools import history_turn, offer, parse_tools
from inferd.structured.tool_syntax import ToolFormat, syntax_named

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
