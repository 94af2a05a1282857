"""OpenAI tools through the official SDK against a real server on the 135M default model:
required and named calls are wholly grammar-constrained, auto calls validate whenever the model
makes one, streams carry the calls as OpenAI streams them, and the history takes tool turns."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.server.live import LiveServer
from tests.server.tool_fixtures import ASK, check_calls, streamed_reply, weather_and_time

SCHEMAS, TOOLS = weather_and_time(40)


def test_required_calls_validate_over_seeds(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        n=3,
        seed=7,
        temperature=1.0,
        max_tokens=400,  # room for several parallel calls: the bound is the schemas, not this
    )
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        check_calls(choice.message.tool_calls, SCHEMAS)


def test_a_named_tool_is_the_one_called(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        n=2,
        seed=2,
        temperature=1.0,
        max_tokens=120,
    )
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls
        assert calls is not None and len(calls) == 1
        check_calls(calls, SCHEMAS, frozenset({"get_time"}))


def test_auto_calls_validate_whenever_made(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, n=3, seed=3, temperature=1.0, max_tokens=60
    )
    for choice in out.choices:
        assert "<tool_call>" not in (choice.message.content or "")
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            check_calls(choice.message.tool_calls, SCHEMAS)
        else:
            assert choice.finish_reason in ("stop", "length")


def test_none_offers_no_tools(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=20
    )
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].message.content


def test_streamed_calls_equal_the_non_streamed_ones(client: openai.OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = {
        "model": model,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": 120,
    }
    full = client.chat.completions.create(**kwargs).choices[0]
    assert full.message.tool_calls is not None
    streamed = streamed_reply(client, kwargs)
    assert streamed.finishes == ["tool_calls"]
    expected = [(c.function.name, c.function.arguments) for c in full.message.tool_calls]
    assert streamed.calls == expected


def test_a_tool_result_in_the_history_gets_an_answer(client: openai.OpenAI, model: str) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    history: list[Any] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    out = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, tool_choice="none", max_tokens=20
    )
    assert out.choices[0].message.content


ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 40}},
    "required": ["answer"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_tools_beside_response_format_each_output_valid(
    client: openai.OpenAI, model: str, choice: str
) -> None:
    """pydantic-ai's NativeOutput and the Agents SDK's output_type send both: every choice is
    either tool calls that validate or (auto only) content that validates against the format."""
    out = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice=choice,  # type: ignore[arg-type]
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": ANSWER, "strict": True},
        },
        n=4,
        seed=11,
        temperature=1.0,
        max_tokens=80,
    )
    for c in out.choices:
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls"
            check_calls(c.message.tool_calls, SCHEMAS)
        else:
            assert choice == "auto"
            jsonschema.validate(json.loads(c.message.content or ""), ANSWER)


_DUP = [TOOLS[0], TOOLS[0]]
BAD = [
    ("duplicate", {"tools": _DUP}, "tools.1.function.name", "duplicate tool name"),
    (
        "unknown named",
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "not among the tools",
    ),
    ("no tools", {"tool_choice": "required"}, "tool_choice", "offers no tools"),
    (
        "bad parameters",
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"typo": 1}}}]},
        "tools.0.function.parameters",
        "unknown keyword 'typo'",
    ),
    (
        "with regex",
        {"tools": TOOLS, "regex": "a+"},
        "tool_choice",
        "cannot be combined",
    ),
    (
        "orphan result",
        {"messages": [*ASK, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]},
        "messages.1.tool_call_id",
        "no assistant tool call",
    ),
    ("not a function", {"tools": [{"type": "web"}]}, "tools.0.type", "function"),
]


@pytest.mark.parametrize(("name", "extra", "param", "needle"), BAD, ids=[b[0] for b in BAD])
def test_bad_tool_requests_are_400s_naming_the_problem(
    server: LiveServer, name: str, extra: dict[str, Any], param: str, needle: str
) -> None:
    body = {"messages": ASK, "max_tokens": 5} | extra
    r = httpx.post(server.api + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    assert needle in err["message"]


# -- a forced call at default sampling, with the schema a client writes ------------------------

LOC = {
    "type": "object",
    "properties": {
        "lat": {"type": "integer", "minimum": -90, "maximum": 90},
        "lon": {"type": "integer", "minimum": -180, "maximum": 180},
    },
    "required": ["lat", "lon"],
}
# pydantic's shape for a nested model: $defs and $ref, and no additionalProperties anywhere.
CITY = {
    "$defs": {"Loc": LOC},
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
        "loc": {"$ref": "#/$defs/Loc"},
    },
    "required": ["name", "population_millions", "loc"],
}
CITY_TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "City", "parameters": CITY}},
    TOOLS[1],
]
EXTRACT: list[Any] = [{"role": "user", "content": "Paris, at 49 N 2 E, has 2 million people."}]


def _city_arguments(arguments: str) -> None:
    """Valid JSON for CITY holding only the keys it lists, at every depth."""
    value = json.loads(arguments)
    jsonschema.validate(value, CITY)
    assert set(value) <= set(CITY["properties"]), value
    assert set(value["loc"]) <= set(LOC["properties"]), value


@pytest.mark.parametrize(
    ("choice", "parallel"),
    [({"type": "function", "function": {"name": "City"}}, None), ("required", False)],
    ids=["named", "parallel-off"],
)
def test_one_call_then_the_turn_ends_at_default_sampling(
    client: openai.OpenAI, model: str, choice: Any, parallel: bool | None
) -> None:
    """No temperature given: a named tool, or parallel calls off, is one call and then
    finish_reason tool_calls, never a second call running to max_tokens."""
    kwargs: dict[str, Any] = {
        "model": model,
        "messages": EXTRACT,
        "tools": CITY_TOOLS,
        "tool_choice": choice,
        "max_tokens": 300,  # room for a second call: the bound is the grammar
        "seed": 5,
    }
    if parallel is not None:
        kwargs["parallel_tool_calls"] = parallel
    out = client.chat.completions.create(**kwargs, n=3)
    for c in out.choices:
        assert c.finish_reason == "tool_calls"
        (call,) = c.message.tool_calls or []
        if call.function.name == "City":
            _city_arguments(call.function.arguments)
        else:
            assert choice == "required"
            check_calls([call], SCHEMAS)
    streamed = streamed_reply(client, kwargs)  # one id per index, arguments joined per index
    assert streamed.finishes == ["tool_calls"]
    ((name, arguments),) = streamed.calls
    if name == "City":
        _city_arguments(arguments)
