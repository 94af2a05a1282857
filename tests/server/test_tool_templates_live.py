"""Tools through a chat template that takes them, on the real 135M default model: served with
inferd's own Llama-3-style and Mistral-style test templates (``--chat-template``) and their
``--tool-call-parser``, the template renders the tools and the tool turns, the model's calls
come in that family's syntax, every call parses and validates against its schema, and a
streamed reply equals the non-streamed one under greedy decoding, on both APIs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from tests.server.live import LiveServer, live_server
from tests.server.tool_fixtures import ASK, check_calls, streamed_reply, weather_and_time

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "tool_templates"
SCHEMAS, TOOLS = weather_and_time(30)


@pytest.fixture(scope="module", params=["llama3_json", "mistral"])
def family(
    request: pytest.FixtureRequest, smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, LiveServer]]:
    name: str = request.param
    log = tmp_path_factory.mktemp(f"serve-{name}") / "serve.log"
    args = [
        "-m",
        str(smollm2_gguf),
        "--dtype",
        "f32",
        "--max-seqs",
        "4",
        "--max-seq-len",
        "2048",
        "--chat-template",
        str(TEMPLATES / f"{name}.jinja"),
        "--tool-call-parser",
        name,
    ]
    with live_server(args, log) as live:
        yield name, live


@pytest.fixture(scope="module")
def client(family: tuple[str, LiveServer]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=family[1].api, api_key="unused", max_retries=0, _strict_response_validation=True
    ) as c:
        yield c


def test_required_calls_validate_over_seeds(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="default",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,  # one call, then the turn ends: no run to max_tokens
        n=2,
        seed=5,
        temperature=1.0,
        max_tokens=80,
    )
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        check_calls(choice.message.tool_calls, SCHEMAS)


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_streamed_equals_non_streamed_under_greedy(client: openai.OpenAI, choice: str) -> None:
    kwargs: dict[str, Any] = {
        "model": "default",
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": choice,
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": 60,
    }
    full = client.chat.completions.create(**kwargs).choices[0]
    calls = full.message.tool_calls or []
    if calls:
        check_calls(calls, SCHEMAS)
    streamed = streamed_reply(client, kwargs)
    assert streamed.calls == [(c.function.name, c.function.arguments) for c in calls]
    assert streamed.content == (full.message.content or "")
    assert streamed.finishes == [full.finish_reason]
    if choice == "required":
        assert calls and full.finish_reason == "tool_calls"


def test_auto_calls_validate_whenever_made(
    client: openai.OpenAI, family: tuple[str, LiveServer]
) -> None:
    out = client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, n=2, seed=3, temperature=1.0, max_tokens=40
    )
    marker = {"llama3_json": '{"name": ', "mistral": "[TOOL_CALLS]"}[family[0]]
    for choice in out.choices:
        assert marker not in (choice.message.content or "")  # any call was read as one
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            check_calls(choice.message.tool_calls, SCHEMAS)


def test_the_template_renders_a_tool_round_trip(client: openai.OpenAI) -> None:
    """An assistant call and its result go to the template as tool_calls and a tool turn; the
    next call the model makes still validates."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    history: list[Any] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
        {"role": "user", "content": "And the time there?"},
    ]
    out = client.chat.completions.create(
        model="default",
        messages=history,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=60,
    )
    calls = out.choices[0].message.tool_calls
    check_calls(calls, SCHEMAS)
    assert calls is not None and [c.function.name for c in calls] == ["get_time"]


def test_anthropic_tool_use_goes_through_the_same_syntax(family: tuple[str, LiveServer]) -> None:
    tools: list[Any] = [
        {"name": n, "description": f"{n} of a place", "input_schema": s} for n, s in SCHEMAS.items()
    ]
    history: list[Any] = [
        *ASK,
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_time",
                    "input": {"timezone": "CET"},
                }
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "9:00"}],
        },
    ]
    kwargs: dict[str, Any] = {
        "model": "default",
        "messages": history,
        "tools": tools,
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "max_tokens": 60,
        "extra_body": {"temperature": 0},
    }
    with anthropic.Anthropic(
        base_url=family[1].url, api_key="unused", max_retries=0, _strict_response_validation=True
    ) as client:
        full = client.messages.create(**kwargs)
        assert full.stop_reason == "tool_use"
        uses = [b for b in full.content if b.type == "tool_use"]
        assert uses
        for block in uses:
            jsonschema.validate(block.input, SCHEMAS[block.name])
        with client.messages.stream(**kwargs) as stream:
            final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        (b.name, b.input) for b in uses
    ]
