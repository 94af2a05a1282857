"""The Responses API (/v1/responses) against a live `inferd serve` of the default model, through
the official SDK in strict mode: create (string and item input, instructions, text.format,
function tools), streams and their accumulator, the stored conversation (retrieve, delete,
input_items, previous_response_id, across a restart), per-key visibility, background + cancel,
bad input, and the OpenAI Agents SDK's default (Responses) model.

The 135M model is weak, so assertions are about structure and consistency (the object
validates, events come in order, streamed equals non-streamed, turns carry their history),
never about meaning. Generations stay short (max_output_tokens), and one server serves the
module; the restart test adds a second on the same store file.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.live import LiveServer, live_server

os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")

KEY, OTHER_KEY = "key-one", "key-two"
CITY_FORMAT = {
    "type": "json_schema",
    "name": "city",
    "strict": True,
    "schema": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}},
        "required": ["name"],
        "additionalProperties": False,
    },
}
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


def _args(model: Path, store: Path) -> list[str]:
    return [
        "-m",
        str(model),
        "--dtype",
        "f32",
        "--max-seq-len",
        "512",
        "--responses-store",
        str(store),
        "--api-key",
        KEY,
        "--api-key",
        OTHER_KEY,
        "--access-log-format",
        "off",
    ]


@pytest.fixture(scope="module")
def store_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("responses") / "responses.sqlite3"


@pytest.fixture(scope="module")
def rserver(smollm2_gguf: Path, store_file: Path) -> Iterator[LiveServer]:
    with live_server(_args(smollm2_gguf, store_file), store_file.parent / "serve.log") as live:
        yield live


def _client(server: LiveServer, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.api, api_key=key, max_retries=0, _strict_response_validation=True
    )


@pytest.fixture(scope="module")
def client(rserver: LiveServer) -> Iterator[openai.OpenAI]:
    with _client(rserver) as c:
        yield c


@pytest.fixture(scope="module")
def other(rserver: LiveServer) -> Iterator[openai.OpenAI]:
    with _client(rserver, OTHER_KEY) as c:
        yield c


def _create(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs = {"model": "default", "temperature": 0, "max_output_tokens": 16} | kwargs
    return client.responses.create(**kwargs)


def _usage_adds_up(response: Any) -> None:
    usage = response.usage
    assert usage.input_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


# -- create -----------------------------------------------------------------------------------


def test_string_input_is_cut_at_max_output_tokens(client: openai.OpenAI) -> None:
    response = _create(client, input="Tell me a long story about a dragon.", max_output_tokens=5)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 5
    _usage_adds_up(response)
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.status == "incomplete"
    assert response.output_text and response.output_text == item.content[0].text


def test_item_input_with_instructions_is_the_chat_prompt(
    client: openai.OpenAI, rserver: LiveServer
) -> None:
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]}]
    instructions = "Answer in one word."
    response = _create(client, input=items, instructions=instructions, max_output_tokens=4)
    chat = httpx.post(
        rserver.api + "/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={
            "model": "default",
            "messages": [
                {"role": "system", "content": instructions},
                {"role": "user", "content": "Name a colour."},
            ],
            "temperature": 0,
            "max_tokens": 4,
        },
        timeout=60,
    ).json()
    # the instructions are the system turn, the items the rest: the same prompt as chat's
    assert response.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert response.output_text == chat["choices"][0]["message"]["content"]
    assert response.instructions == instructions
    as_string = _create(
        client, input="Name a colour.", instructions=instructions, max_output_tokens=4
    )
    assert as_string.usage.input_tokens == response.usage.input_tokens  # a string: one user turn


def test_json_schema_format_holds_the_output(client: openai.OpenAI) -> None:
    response = _create(
        client, input="Name a city.", text={"format": CITY_FORMAT}, max_output_tokens=40
    )
    assert response.status == "completed"
    value = json.loads(response.output_text)
    assert set(value) == {"name"} and len(value["name"]) <= 12
    assert response.text.format.type == "json_schema"


def test_json_object_format(client: openai.OpenAI) -> None:
    response = _create(
        client,
        input="Give a JSON object.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=24,
    )
    if response.status == "completed":
        assert isinstance(json.loads(response.output_text), dict)
    else:  # cut: still the start of an object
        assert response.output_text.lstrip().startswith("{")


def test_function_call_then_its_output(client: openai.OpenAI) -> None:
    first = _create(
        client,
        input="What is the weather in Paris?",
        tools=[WEATHER_TOOL],
        tool_choice="required",
        max_output_tokens=40,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    assert first.tools[0].name == "get_weather"
    second = _create(
        client,
        previous_response_id=first.id,
        input=[
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 C"},
        ],
        tools=[WEATHER_TOOL],
        max_output_tokens=8,
    )
    assert second.previous_response_id == first.id
    # the history (the question and the call) is in the prompt
    assert second.usage.input_tokens > first.usage.input_tokens
    # the same conversation sent whole gives the same prompt
    whole = _create(
        client,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": calls[0].name,
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 C"},
        ],
        tools=[WEATHER_TOOL],
        max_output_tokens=8,
    )
    assert whole.usage.input_tokens == second.usage.input_tokens
    assert whole.output_text == second.output_text


# -- streams ----------------------------------------------------------------------------------


def _events(client: openai.OpenAI, **kwargs: Any) -> tuple[list[Any], Any]:
    kwargs = {"model": "default", "temperature": 0} | kwargs
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        return events, stream.get_final_response()


def _check_order(events: list[Any]) -> None:
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    open_items: set[int] = set()
    for event in events[2:-1]:
        index = event.output_index
        if event.type == "response.output_item.added":
            assert index not in open_items
            open_items.add(index)
        else:
            assert index in open_items, event.type  # every event is inside its item
        if event.type == "response.output_item.done":
            open_items.remove(index)
    assert not open_items


def test_stream_equals_the_plain_response(client: openai.OpenAI) -> None:
    ask = {"input": "Name a city.", "text": {"format": CITY_FORMAT}, "max_output_tokens": 40}
    events, final = _events(client, **ask)
    _check_order(events)
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    plain = _create(client, **ask)
    assert final.output_text == deltas == plain.output_text
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_streamed_function_call_equals_the_plain_one(client: openai.OpenAI) -> None:
    ask = {
        "input": "What is the weather in Rome?",
        "tools": [WEATHER_TOOL],
        "tool_choice": "required",
        "parallel_tool_calls": False,  # one call, then the grammar ends the turn
        "max_output_tokens": 40,
    }
    events, final = _events(client, **ask)
    _check_order(events)
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert pieces == done.arguments
    plain = _create(client, **ask)

    def calls(response: Any) -> list[tuple[str, str]]:
        return [(o.name, o.arguments) for o in response.output if o.type == "function_call"]

    assert calls(final) == calls(plain) and calls(plain)
    assert calls(final)[0][1] == done.arguments


def test_incomplete_stream_ends_with_response_incomplete(rserver: LiveServer) -> None:
    body = {"model": "default", "input": "Tell a story.", "max_output_tokens": 3, "stream": True}
    with httpx.stream(
        "POST", rserver.api + "/responses", json=body, headers={"Authorization": f"Bearer {KEY}"}
    ) as reply:
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    last = json.loads(lines[-1].removeprefix("data: "))
    assert last["type"] == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


# -- the store --------------------------------------------------------------------------------


def test_retrieve_delete_and_input_items(client: openai.OpenAI) -> None:
    items = [{"role": "user", "content": f"Item number {i}."} for i in range(5)]
    response = _create(client, input=items, max_output_tokens=2)
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()
    newest_first = client.responses.input_items.list(response.id, limit=2)
    assert len(newest_first.data) == 2 and newest_first.has_more
    assert newest_first.data[0].content[0].text == "Item number 4."
    everything = [i.content[0].text for i in client.responses.input_items.list(response.id)]
    assert everything == [f"Item number {i}." for i in reversed(range(5))]
    oldest = client.responses.input_items.list(response.id, order="asc", limit=2)
    rest = client.responses.input_items.list(
        response.id, order="asc", after=oldest.data[-1].id, limit=10
    )
    texts = [i.content[0].text for i in [*oldest.data, *rest.data]]
    assert texts == [f"Item number {i}." for i in range(5)] and not rest.has_more
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(response.id)


def _three_turns(client: openai.OpenAI) -> list[Any]:
    turns: list[Any] = []
    for text in ("My name is Ada.", "I live in Paris.", "What is my name?"):
        previous = turns[-1].id if turns else None
        turns.append(
            _create(client, input=text, previous_response_id=previous, max_output_tokens=6)
        )
    return turns


def test_three_turn_conversation(client: openai.OpenAI) -> None:
    turns = _three_turns(client)
    sizes = [t.usage.input_tokens for t in turns]
    # each turn's prompt holds the previous turn's prompt and its reply
    for before, after in itertools.pairwise(turns):
        assert after.usage.input_tokens > before.usage.input_tokens + before.usage.output_tokens
    assert turns[2].previous_response_id == turns[1].id
    assert sizes == sorted(sizes)


def test_conversation_survives_a_restart(
    client: openai.OpenAI, store_file: Path, smollm2_gguf: Path
) -> None:
    turns = _three_turns(client)
    log = store_file.parent / "restart.log"
    with live_server(_args(smollm2_gguf, store_file), log) as second, _client(second) as again:
        assert again.responses.retrieve(turns[-1].id).model_dump() == turns[-1].model_dump()
        fourth = _create(
            again, input="And where?", previous_response_id=turns[-1].id, max_output_tokens=2
        )
        # the same fourth turn on the first server: the same prompt
        here = _create(
            client, input="And where?", previous_response_id=turns[-1].id, max_output_tokens=2
        )
        assert fourth.usage.input_tokens == here.usage.input_tokens
        assert fourth.output_text == here.output_text


def test_a_stored_response_is_visible_only_to_its_key(
    client: openai.OpenAI, other: openai.OpenAI
) -> None:
    response = _create(client, input="Hi.", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(response.id)
    with pytest.raises(openai.BadRequestError) as err:
        _create(other, input="Hi.", previous_response_id=response.id, max_output_tokens=2)
    assert err.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert client.responses.retrieve(response.id).id == response.id  # not deleted by the other


def test_store_false_is_not_kept(client: openai.OpenAI) -> None:
    response = _create(client, input="Hi.", store=False, max_output_tokens=2)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


# -- background -------------------------------------------------------------------------------


def test_background_response_completes(client: openai.OpenAI) -> None:
    queued = _create(client, input="Name a city.", background=True, max_output_tokens=6)
    assert queued.status in ("queued", "in_progress") and queued.background
    deadline = time.monotonic() + 120
    current = queued
    while current.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.2)
        current = client.responses.retrieve(queued.id)
    assert current.status in ("completed", "incomplete")
    assert current.output_text and current.usage.output_tokens <= 6


# An essay the model cannot finish within its budget: a string longer than BUDGET tokens can
# spell (SmolLM2's longest token is 81 characters), so it ends only by being cut or cancelled.
BUDGET = 200
ESSAY_FORMAT = {
    "type": "json_schema",
    "name": "essay",
    "strict": True,
    "schema": {
        "type": "object",
        "properties": {"essay": {"type": "string", "minLength": 100 * BUDGET}},
        "required": ["essay"],
        "additionalProperties": False,
    },
}


def _metric(rserver: LiveServer, name: str) -> float:
    """One of the server's /metrics samples (behind the API key here)."""
    auth = {"Authorization": f"Bearer {KEY}"}
    body = httpx.get(rserver.url + "/metrics", headers=auth, timeout=10).text
    samples = (line for line in body.splitlines() if line.startswith(name + "{"))
    return float(next(samples).split()[-1])


def test_background_response_is_cancelled(client: openai.OpenAI, rserver: LiveServer) -> None:
    """Cancelling stops the generation: the response says cancelled and stays so, and the
    engine lets go of the request before it has generated what it would have without the
    cancel (BUDGET tokens: the format above keeps it from ending sooner)."""
    generated = _metric(rserver, "inferd_generation_tokens_total")
    queued = _create(
        client,
        input="Write a long essay.",
        background=True,
        max_output_tokens=BUDGET,
        text={"format": ESSAY_FORMAT},
    )
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    deadline = time.monotonic() + 120
    busy = ("inferd_requests_running", "inferd_requests_waiting")
    while any(_metric(rserver, name) for name in busy):
        assert time.monotonic() < deadline, "the cancelled response kept generating"
        time.sleep(0.2)
    assert _metric(rserver, "inferd_generation_tokens_total") - generated < BUDGET
    after = client.responses.retrieve(queued.id)
    assert after.status == "cancelled"  # and it stays cancelled


def test_only_background_responses_can_be_cancelled(client: openai.OpenAI) -> None:
    response = _create(client, input="Hi.", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(response.id)


# -- bad input --------------------------------------------------------------------------------


def _status(rserver: LiveServer, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    reply = httpx.post(
        rserver.api + "/responses",
        json={"model": "default", "max_output_tokens": 2} | body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    return reply.status_code, reply.json()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"previous_response_id": "resp_nothing", "input": "x"}, "previous_response_id"),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
            "input.0.call_id",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "temperature": -1}, "temperature"),
        ({"input": "x", "store": False, "background": True}, "background"),
        ({}, "input"),
    ],
)
def test_bad_input_is_a_400_in_the_envelope(
    rserver: LiveServer, body: dict[str, Any], param: str
) -> None:
    status, reply = _status(rserver, body)
    assert status == 400, reply
    assert reply["error"]["param"] == param and reply["error"]["type"] == "invalid_request_error"


def test_oversized_input_is_refused_unless_truncated(rserver: LiveServer) -> None:
    turns = [{"role": "user", "content": "word " * 150} for _ in range(6)]  # > 512 tokens
    status, reply = _status(rserver, {"input": turns})
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded"
    status, reply = _status(rserver, {"input": turns, "truncation": "auto"})
    assert status == 200, reply
    assert reply["usage"]["input_tokens"] + 2 <= 512 and reply["truncation"] == "auto"


def test_unknown_response_is_404_in_the_envelope(rserver: LiveServer) -> None:
    reply = httpx.get(
        rserver.api + "/responses/resp_missing", headers={"Authorization": f"Bearer {KEY}"}
    )
    assert reply.status_code == 404
    assert reply.json()["error"]["type"] == "not_found_error"


# -- the OpenAI Agents SDK --------------------------------------------------------------------


def test_openai_agents_default_model_runs_a_function_tool(rserver: LiveServer) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return f"21 degrees in {city}"

    async def run() -> Any:
        client = openai.AsyncOpenAI(base_url=rserver.api, api_key=KEY, max_retries=0)
        agent = Agent(
            name="weather",
            instructions="Answer with the weather tool.",
            model=OpenAIResponsesModel(model="default", openai_client=client),
            tools=[get_weather],
            # The run ends with the tool's result: at the next turn (tool_choice auto) the 135M
            # model calls the tool again rather than answer, a choice about meaning, not protocol.
            tool_use_behavior="stop_on_first_tool",
            model_settings=ModelSettings(
                temperature=0.0,
                max_tokens=60,
                tool_choice="required",
                parallel_tool_calls=False,
            ),
        )
        try:
            return await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert calls, "the tool was never called"
    kinds = [item.type for item in result.new_items]
    assert "tool_call_item" in kinds and "tool_call_output_item" in kinds
    assert result.final_output == f"21 degrees in {calls[0]}"


def test_openai_agents_streamed_run_over_responses(rserver: LiveServer) -> None:
    """The same agent run streamed: the SDK reads the typed events into its items."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return f"21 degrees in {city}"

    async def run() -> tuple[Any, list[Any]]:
        client = openai.AsyncOpenAI(base_url=rserver.api, api_key=KEY, max_retries=0)
        agent = Agent(
            name="weather",
            instructions="Answer with the weather tool.",
            model=OpenAIResponsesModel(model="default", openai_client=client),
            tools=[get_weather],
            tool_use_behavior="stop_on_first_tool",
            model_settings=ModelSettings(
                temperature=0.0, max_tokens=60, tool_choice="required", parallel_tool_calls=False
            ),
        )
        try:
            streamed = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4)
            raw = [e.data async for e in streamed.stream_events() if e.type == "raw_response_event"]
            return streamed, raw
        finally:
            await client.close()

    result, raw = asyncio.run(run())
    assert calls, "the tool was never called"
    assert [e.sequence_number for e in raw] == list(range(len(raw)))
    assert raw[-1].type == "response.completed"
    assert result.final_output == f"21 degrees in {calls[0]}"


PLACE_TOOL = {
    "type": "function",
    "name": "record_place",
    "description": "Record a place.",
    # pydantic's shape for a nested model: $defs and $ref, no additionalProperties anywhere
    "parameters": {
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
    },
}


def test_a_named_function_is_one_call_at_default_sampling(client: openai.OpenAI) -> None:
    """No temperature: the named function is called once, then the response completes; its
    arguments hold only the schema's keys, $defs resolved, streamed or not."""
    ask: dict[str, Any] = {
        "model": "default",
        "input": "Paris is at 49 N 2 E.",
        "tools": [PLACE_TOOL, WEATHER_TOOL],
        "tool_choice": {"type": "function", "name": "record_place"},
        "max_output_tokens": 150,  # room for a second call: the bound is the grammar
    }
    plain = client.responses.create(**ask)
    with client.responses.stream(**ask) as stream:
        streamed = stream.get_final_response()
    for response in (plain, streamed):
        assert response.status == "completed"
        (call,) = [o for o in response.output if o.type == "function_call"]
        assert call.name == "record_place"
        value = json.loads(call.arguments)
        assert set(value) == {"name", "loc"} and set(value["loc"]) == {"lat", "lon"}
