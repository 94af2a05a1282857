"""Anthropic tool use through the official SDK against a real server: any / tool calls are
grammar-constrained and validate, streams carry them as input_json_delta events, the history
takes tool_use and tool_result blocks, and count_tokens counts the tools."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from tests.server.live import LiveServer

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"name": "get_weather", "description": "the weather in a city", "input_schema": WEATHER},
    {"name": "get_time", "description": "the time", "input_schema": {"type": "object"}},
]
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Rome?"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(
        base_url=server.url, api_key="unused", max_retries=0, _strict_response_validation=True
    ) as c:
        yield c


@pytest.fixture(scope="module")
def model(server: LiveServer) -> str:
    return str(httpx.get(server.api + "/models").json()["data"][0]["id"])


def _calls(message: Any) -> list[Any]:
    return [b for b in message.content if b.type == "tool_use"]


def test_any_and_named_tool_calls_validate(client: anthropic.Anthropic, model: str) -> None:
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        out = client.messages.create(
            model=model,
            max_tokens=120,
            messages=ASK,
            tools=TOOLS,
            tool_choice=choice,  # type: ignore[arg-type]
            extra_body=GREEDY,
        )
        assert out.stop_reason == "tool_use"
        calls = _calls(out)
        assert calls and all(c.id.startswith("toolu_") for c in calls)
        for call in calls:
            if choice["type"] == "tool":
                assert call.name == "get_weather"
            if call.name == "get_weather":
                jsonschema.validate(call.input, WEATHER)


def test_streamed_tool_use_equals_the_message(client: anthropic.Anthropic, model: str) -> None:
    kwargs: dict[str, Any] = {
        "model": model,
        "max_tokens": 120,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "extra_body": GREEDY,
    }
    full = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert "input_json" in kinds  # the SDK's event for input_json_delta
    assert streamed.stop_reason == full.stop_reason == "tool_use"
    assert [(c.name, c.input) for c in _calls(streamed)] == [
        (c.name, c.input) for c in _calls(full)
    ]


def test_tool_results_in_the_history(client: anthropic.Anthropic, model: str) -> None:
    history: list[Any] = [
        *ASK,
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Rome"},
                }
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 24C"}],
        },
    ]
    out = client.messages.create(
        model=model, max_tokens=20, messages=history, tools=TOOLS, extra_body=GREEDY
    )
    assert out.stop_reason in ("end_turn", "max_tokens", "tool_use")
    orphan = [
        *ASK,
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "1"}]},
    ]
    with pytest.raises(anthropic.BadRequestError, match="no tool_use block with id 'x'"):
        client.messages.create(model=model, max_tokens=5, messages=orphan)


def test_count_tokens_counts_the_tools(client: anthropic.Anthropic, model: str) -> None:
    bare = client.messages.count_tokens(model=model, messages=ASK)
    with_tools = client.messages.count_tokens(model=model, messages=ASK, tools=TOOLS)
    assert with_tools.input_tokens > bare.input_tokens + 20


def test_bad_tool_choice_is_refused(client: anthropic.Anthropic, model: str) -> None:
    with pytest.raises(anthropic.BadRequestError, match="not among the tools"):
        client.messages.create(
            model=model,
            max_tokens=5,
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "tool", "name": "nope"},
        )


# pydantic's shape for a nested model: $defs and $ref, no additionalProperties anywhere.
PLACE = {
    "$defs": {
        "Loc": {
            "type": "object",
            "properties": {
                "lat": {"type": "integer", "minimum": -90, "maximum": 90},
                "lon": {"type": "integer", "minimum": -180, "maximum": 180},
            },
            "required": ["lat", "lon"],
        }
    },
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "loc": {"$ref": "#/$defs/Loc"},
    },
    "required": ["name", "loc"],
}
PLACE_TOOLS: list[Any] = [
    {"name": "record_place", "description": "Record a place.", "input_schema": PLACE},
    TOOLS[0],
]


@pytest.mark.parametrize(
    "choice",
    [
        {"type": "tool", "name": "record_place"},
        {"type": "any", "disable_parallel_tool_use": True},
    ],
    ids=["tool", "any-one"],
)
def test_one_tool_use_then_the_turn_ends_at_default_sampling(
    client: anthropic.Anthropic, model: str, choice: dict[str, Any]
) -> None:
    """No temperature: a named tool, or parallel use disabled, is one tool_use block whose
    input holds only the schema's keys ($defs resolved), streamed or not."""
    kwargs: dict[str, Any] = {
        "model": model,
        "max_tokens": 300,  # room for a second call: the bound is the grammar
        "messages": [{"role": "user", "content": "Paris is at 49 N 2 E."}],
        "tools": PLACE_TOOLS,
        "tool_choice": choice,
    }
    plain = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    for out in (plain, streamed):
        assert out.stop_reason == "tool_use"
        (use,) = _calls(out)
        if use.name == "record_place":
            jsonschema.validate(use.input, PLACE)
            assert set(use.input) <= {"name", "loc"} and set(use.input["loc"]) <= {"lat", "lon"}
        else:
            assert choice["type"] == "any"
            jsonschema.validate(use.input, WEATHER)


@pytest.mark.parametrize("choice", [{"type": {}}, {"type": "tool", "name": ["x"]}])
def test_a_tool_choice_of_the_wrong_shape_is_a_400_in_the_envelope(
    server: LiveServer, model: str, choice: Any
) -> None:
    body = {"model": model, "max_tokens": 5, "messages": ASK, "tools": TOOLS, "tool_choice": choice}
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 400, r.text
    reply = r.json()
    assert reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error"
    assert "tool_choice" in reply["error"]["message"]
