"""Real agent and extraction clients driven against a live `inferd serve` of the default model:
pydantic-ai, the OpenAI Agents SDK, langchain-openai, instructor and the anthropic SDK, each in
strict mode where it has one. The 135M model is weak, so every assertion is about validity (the
object validates, the tool was called with valid arguments, the round trip completed), never
meaning. (instructor is installed without its pins: see the Makefile.)"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from typing import Any, Literal

import anthropic
import httpx
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.server.live import LiveServer

# No client may reach a hub: tracing, telemetry and key look-ups stay local.
for _key, _value in {
    "OPENAI_API_KEY": "dummy",
    "ANTHROPIC_API_KEY": "dummy",
    "LANGSMITH_TRACING": "false",
    "LANGCHAIN_TRACING_V2": "false",
    "OPENAI_AGENTS_DISABLE_TRACING": "1",
    "LOGFIRE_SEND_TO_LOGFIRE": "false",
}.items():
    os.environ.setdefault(_key, _value)

MAX_TOKENS = 80


class City(BaseModel):
    """The structured answer every client is asked for: small, closed, bounded strings."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=40)
    unit: Literal["celsius", "fahrenheit"]


ASK = "What is the weather in Paris, in celsius?"


@pytest.fixture(scope="module")
def model(server: LiveServer) -> str:
    return str(httpx.get(server.api + "/models").json()["data"][0]["id"])


def _weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
    """Get the current weather in a city."""
    Weather(city=city, unit=unit)  # raises if the client let invalid arguments through
    return f"21 degrees {unit} in {city}"


# --- pydantic-ai -----------------------------------------------------------------------------


def _one_round_trip(ctx: Any) -> Any:
    """pydantic-ai's settings per step: step one must call get_weather; once its result is back
    the agent must answer, so a run is exactly one round trip whatever the small model prefers."""
    from pydantic_ai.messages import ToolReturnPart
    from pydantic_ai.settings import ModelSettings

    done = any(isinstance(p, ToolReturnPart) for m in ctx.messages for p in getattr(m, "parts", []))
    choice: Any = "none" if done else ["get_weather"]
    return ModelSettings(temperature=0.0, max_tokens=MAX_TOKENS, tool_choice=choice)


def test_pydantic_ai_agent_tool_round_trip(server: LiveServer, model: str) -> None:
    from openai import AsyncOpenAI
    from pydantic_ai import Agent
    from pydantic_ai.messages import ToolCallPart, ToolReturnPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    calls: list[Weather] = []

    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """Get the current weather in a city."""
        calls.append(Weather(city=city, unit=unit))
        return _weather(city, unit)

    async def run() -> Any:
        # our own client and event loop, both closed here (run_sync leaves its loop open)
        client = AsyncOpenAI(base_url=server.api, api_key="dummy", max_retries=0)
        chat = OpenAIChatModel(model, provider=OpenAIProvider(openai_client=client))
        agent = Agent(chat, output_type=City, tools=[get_weather], model_settings=_one_round_trip)
        try:
            return await agent.run(ASK)
        finally:
            await client.close()

    result = asyncio.run(run())

    assert isinstance(result.output, City)
    assert len(calls) == 1
    parts = [p for m in result.all_messages() for p in m.parts]
    assert any(isinstance(p, ToolCallPart) and p.tool_name == "get_weather" for p in parts)
    assert any(isinstance(p, ToolReturnPart) and p.tool_name == "get_weather" for p in parts)


# --- OpenAI Agents SDK -----------------------------------------------------------------------


def test_openai_agents_function_tool_over_chat_completions(server: LiveServer, model: str) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[Weather] = []

    @function_tool  # strict JSON schema by default
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """Get the current weather in a city."""
        calls.append(Weather(city=city, unit=unit))
        return _weather(city, unit)

    async def run() -> Any:
        client = AsyncOpenAI(base_url=server.api, api_key="dummy", max_retries=0)
        agent = Agent(
            name="weather",
            instructions="Answer with the weather tool.",
            model=OpenAIChatCompletionsModel(model=model, openai_client=client),
            tools=[get_weather],
            # required on the first turn; the SDK resets it to auto after the call so the
            # tool result goes back and a final text answer ends the run
            model_settings=ModelSettings(
                temperature=0.0, max_tokens=MAX_TOKENS, tool_choice="required"
            ),
        )
        try:
            return await Runner.run(agent, ASK, max_turns=4)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert calls, "the tool was never called"
    kinds = [item.type for item in result.new_items]
    assert "tool_call_item" in kinds and "tool_call_output_item" in kinds
    assert isinstance(result.final_output, str)


# --- langchain-openai ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_openai(server: LiveServer, model: str) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=model,
        base_url=server.api,
        api_key="dummy",  # type: ignore[arg-type]
        temperature=0,
        max_tokens=MAX_TOKENS,  # type: ignore[call-arg]
        max_retries=0,
    )


def test_langchain_with_structured_output_json_schema(chat_openai: Any) -> None:
    structured = chat_openai.with_structured_output(City, method="json_schema", strict=True)
    out = structured.invoke("Name a city and its country.")
    assert isinstance(out, City)


def test_langchain_bind_tools_parses_tool_calls(chat_openai: Any) -> None:
    from langchain_core.messages import AIMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """Get the current weather in a city."""
        return _weather(city, unit)

    bound = chat_openai.bind_tools([get_weather], tool_choice="get_weather", strict=True)
    out = bound.invoke(ASK)
    assert isinstance(out, AIMessage)
    assert out.tool_calls and not out.invalid_tool_calls
    for call in out.tool_calls:
        assert call["name"] == "get_weather" and call["id"]
        Weather.model_validate(call["args"])


# --- anthropic SDK ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def claude(server: LiveServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(
        base_url=server.url, api_key="dummy", max_retries=0, _strict_response_validation=True
    ) as c:
        yield c


def test_anthropic_named_tool_use_validates(claude: anthropic.Anthropic, model: str) -> None:
    out = claude.messages.create(
        model=model,
        max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": ASK}],
        tools=[
            {
                "name": "get_weather",
                "description": "Get the current weather in a city.",
                "input_schema": Weather.model_json_schema(),
            }
        ],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0},  # this SDK release has no temperature parameter
    )
    assert out.stop_reason == "tool_use"
    uses = [b for b in out.content if b.type == "tool_use"]
    assert uses
    for use in uses:
        assert use.name == "get_weather" and use.id.startswith("toolu_")
        Weather.model_validate(use.input)


# --- streaming: each client's own SSE parser over the same calls ------------------------------


def test_openai_agents_streamed_run_completes(server: LiveServer, model: str) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[Weather] = []

    @function_tool
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """Get the current weather in a city."""
        calls.append(Weather(city=city, unit=unit))
        return _weather(city, unit)

    async def run() -> Any:
        client = AsyncOpenAI(base_url=server.api, api_key="dummy", max_retries=0)
        agent = Agent(
            name="weather",
            instructions="Answer with the weather tool.",
            model=OpenAIChatCompletionsModel(model=model, openai_client=client),
            tools=[get_weather],
            model_settings=ModelSettings(
                temperature=0.0, max_tokens=MAX_TOKENS, tool_choice="required", include_usage=True
            ),
        )
        try:
            streamed = Runner.run_streamed(agent, ASK, max_turns=4)
            async for _ in streamed.stream_events():
                pass
            return streamed
        finally:
            await client.close()

    result = asyncio.run(run())
    assert calls, "the tool was never called"
    assert isinstance(result.final_output, str)
    assert result.context_wrapper.usage.output_tokens > 0


def test_langchain_streamed_tool_call_chunks_assemble(chat_openai: Any) -> None:
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """Get the current weather in a city."""
        return _weather(city, unit)

    bound = chat_openai.bind_tools([get_weather], tool_choice="get_weather", strict=True)
    whole: Any = None
    for chunk in bound.stream(ASK):
        whole = chunk if whole is None else whole + chunk
    assert whole is not None and whole.tool_calls and not whole.invalid_tool_calls
    for call in whole.tool_calls:
        assert call["name"] == "get_weather"
        Weather.model_validate(call["args"])


def test_pydantic_ai_streamed_structured_output(server: LiveServer, model: str) -> None:
    from openai import AsyncOpenAI
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    async def run() -> Any:
        client = AsyncOpenAI(base_url=server.api, api_key="dummy", max_retries=0)
        chat = OpenAIChatModel(model, provider=OpenAIProvider(openai_client=client))
        settings = ModelSettings(temperature=0.0, max_tokens=MAX_TOKENS)
        agent = Agent(chat, output_type=City, model_settings=settings)
        try:
            async with agent.run_stream("Name a city and its country.") as streamed:
                return await streamed.get_output()
        finally:
            await client.close()

    assert isinstance(asyncio.run(run()), City)


def test_anthropic_streamed_tool_use_validates(claude: anthropic.Anthropic, model: str) -> None:
    with claude.messages.stream(
        model=model,
        max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": ASK}],
        tools=[
            {
                "name": "get_weather",
                "description": "Get the current weather in a city.",
                "input_schema": Weather.model_json_schema(),
            }
        ],
        tool_choice={"type": "any"},
        extra_body={"temperature": 0},
    ) as stream:
        out = stream.get_final_message()
    assert out.stop_reason == "tool_use"
    uses = [b for b in out.content if b.type == "tool_use"]
    assert uses
    for use in uses:
        Weather.model_validate(use.input)


# --- response_format json_schema beside tools (what instructor's JSON_SCHEMA mode sends) ------


def test_pydantic_ai_native_output_beside_a_tool(server: LiveServer, model: str) -> None:
    """NativeOutput sends response_format json_schema (strict) with the tools list; the tool round
    trip runs first, then the final answer is held to the schema."""
    from openai import AsyncOpenAI
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    calls: list[Weather] = []

    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """Get the current weather in a city."""
        calls.append(Weather(city=city, unit=unit))
        return _weather(city, unit)

    async def run() -> Any:
        client = AsyncOpenAI(base_url=server.api, api_key="dummy", max_retries=0)
        chat = OpenAIChatModel(model, provider=OpenAIProvider(openai_client=client))
        agent = Agent(
            chat,
            output_type=NativeOutput(City, strict=True),
            tools=[get_weather],
            model_settings=_one_round_trip,
        )
        try:
            return await agent.run(ASK)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert isinstance(result.output, City)
    assert len(calls) == 1


def test_openai_agents_structured_output_type(server: LiveServer, model: str) -> None:
    """An Agent with output_type sends response_format json_schema strict over chat completions."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    async def run() -> Any:
        client = AsyncOpenAI(base_url=server.api, api_key="dummy", max_retries=0)
        agent = Agent(
            name="cities",
            instructions="Name a city and its country.",
            model=OpenAIChatCompletionsModel(model=model, openai_client=client),
            output_type=City,
            model_settings=ModelSettings(temperature=0.0, max_tokens=MAX_TOKENS),
        )
        try:
            return await Runner.run(agent, "Name a city.", max_turns=2)
        finally:
            await client.close()

    assert isinstance(asyncio.run(run()).final_output, City)


# --- instructor ------------------------------------------------------------------------------


class Reading(BaseModel):
    """instructor's response model: an int and a closed set, the shapes extraction asks most."""

    model_config = ConfigDict(extra="forbid")
    degrees: int = Field(ge=-100, le=100)
    unit: Literal["celsius", "fahrenheit"]


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_extracts_a_response_model(server: LiveServer, model: str, mode: str) -> None:
    """TOOLS sends a named function tool; JSON_SCHEMA sends response_format json_schema. Either
    way instructor validates the reply into the model, and max_retries=0 means one request: a
    reply that failed validation would raise here instead of being retried into shape."""
    import instructor
    from openai import OpenAI

    with OpenAI(base_url=server.api, api_key="dummy", max_retries=0) as openai_client:
        client = instructor.from_openai(openai_client, mode=instructor.Mode[mode])
        out, raw = client.chat.completions.create_with_completion(
            model=model,
            response_model=Reading,
            messages=[{"role": "user", "content": "It is 21 degrees celsius in Paris."}],
            temperature=0,
            max_tokens=MAX_TOKENS,
            max_retries=0,
        )
    assert isinstance(out, Reading)
    Reading.model_validate(out.model_dump())
    choice = raw.choices[0]
    if mode == "TOOLS":  # the reply really came as a tool call, not text instructor salvaged
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    else:
        assert choice.message.content and not choice.message.tool_calls


# --- anthropic SDK: structured outputs (output_config.format) --------------------------------

FORECAST = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "high": {"type": "integer", "minimum": -50, "maximum": 60},
        "sky": {"enum": ["clear", "cloudy", "rain"]},
    },
    "required": ["city", "high", "sky"],
    "additionalProperties": False,
}


def test_anthropic_output_config_format_validates_streamed_or_not(
    claude: anthropic.Anthropic, model: str
) -> None:
    import jsonschema

    request: dict[str, Any] = {
        "model": model,
        "max_tokens": MAX_TOKENS,
        "messages": [{"role": "user", "content": "Tomorrow's forecast for Oslo?"}],
        "output_config": {"format": {"type": "json_schema", "schema": FORECAST}},
        "extra_body": {"temperature": 0},
    }
    out = claude.messages.create(**request)
    assert out.stop_reason == "end_turn"  # the schema closed the object within max_tokens
    (block,) = out.content
    assert block.type == "text"
    jsonschema.validate(json.loads(block.text), FORECAST)
    with claude.messages.stream(**request) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == ["text"]
    assert streamed.content[0].text == block.text  # type: ignore[union-attr]


def test_anthropic_parse_with_an_output_format_model(
    claude: anthropic.Anthropic, model: str
) -> None:
    """messages.parse turns a pydantic model into output_config.format and parses the reply."""
    out = claude.messages.parse(
        model=model,
        max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": "Name a city and its country."}],
        output_format=City,
        extra_body={"temperature": 0},
    )
    assert isinstance(out.parsed_output, City)


@pytest.mark.parametrize(
    ("fmt", "field"),
    [
        ({"type": "json_schema", "schema": {"type": "object", "proprties": {}}}, "proprties"),
        ({"type": "json_schema", "schema": {"enum": list(range(5000))}}, "enums"),
        ({"type": "json_schema"}, "output_config.format.schema"),
        ({"type": "regex", "schema": {}}, "output_config.format.type"),
    ],
    ids=["unknown-keyword", "huge-enum", "no-schema", "not-json-schema"],
)
def test_anthropic_bad_output_format_is_a_400_naming_it(
    claude: anthropic.Anthropic, model: str, fmt: dict[str, Any], field: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(
            model=model,
            max_tokens=8,
            messages=[{"role": "user", "content": "Hi"}],
            output_config={"format": fmt},  # type: ignore[typeddict-item,call-overload,unused-ignore]
        )
    assert caught.value.status_code == 400
    assert field in caught.value.message and "output_config.format" in caught.value.message


# --- each client at its default sampling, with the schemas it writes itself ---------------------
# No temperature: the server's default sampling, as a user who sets nothing gets. The models
# are open (no extra="forbid": no additionalProperties) and nested (pydantic's $defs / $ref),
# the shape these clients send most; numbers are bounded integers so a call ends in the budget.

DEFAULT_MAX_TOKENS = 200
EXTRACT = "Paris, at 49 N 2 E, has 2 million people."


class Loc(BaseModel):
    lat: int = Field(ge=-90, le=90)
    lon: int = Field(ge=-180, le=180)


class Place(BaseModel):
    """A place and where it is."""

    name: str = Field(max_length=40)
    population_millions: int = Field(ge=0, le=100)
    loc: Loc


def _only_place_keys(args: Any) -> None:
    """The arguments are a Place with no key the schema did not list, at any depth."""
    assert set(args) <= set(Place.model_fields), args
    assert set(args["loc"]) <= set(Loc.model_fields), args
    Place.model_validate(args)


def test_instructor_tools_mode_at_default_sampling(server: LiveServer, model: str) -> None:
    """A named function tool: one call, then the turn ends, streamed or not."""
    import instructor
    from openai import OpenAI

    request: dict[str, Any] = {
        "model": model,
        "response_model": Place,
        "messages": [{"role": "user", "content": EXTRACT}],
        "max_tokens": DEFAULT_MAX_TOKENS,
        "max_retries": 0,
    }
    with OpenAI(base_url=server.api, api_key="dummy", max_retries=0) as openai_client:
        client = instructor.from_openai(openai_client, mode=instructor.Mode.TOOLS)
        out, raw = client.chat.completions.create_with_completion(**request)
        partials = list(client.chat.completions.create_partial(**request))
    assert isinstance(out, Place)
    (choice,) = raw.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    _only_place_keys(json.loads(call.function.arguments))
    _only_place_keys(partials[-1].model_dump())  # the stream's calls assembled into one Place


def test_langchain_forced_tool_at_default_sampling(server: LiveServer, model: str) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model=model,
        base_url=server.api,
        api_key="dummy",  # type: ignore[arg-type]
        max_tokens=DEFAULT_MAX_TOKENS,  # type: ignore[call-arg]
        max_retries=0,
    )
    bound = chat.bind_tools([Place], tool_choice="Place")
    out = bound.invoke(EXTRACT)
    whole: Any = None
    for chunk in bound.stream(EXTRACT):
        whole = chunk if whole is None else whole + chunk
    for message in (out, whole):
        assert message.response_metadata["finish_reason"] == "tool_calls"
        assert not message.invalid_tool_calls  # a stream's calls each under its own index
        (call,) = message.tool_calls
        assert call["name"] == "Place"
        _only_place_keys(call["args"])


def test_openai_agents_named_tool_at_default_sampling(server: LiveServer, model: str) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    recorded: list[Place] = []

    @function_tool
    def record_place(place: Place) -> str:
        """Record a place."""
        recorded.append(place)
        return "recorded"

    async def run() -> list[Any]:
        client = AsyncOpenAI(base_url=server.api, api_key="dummy", max_retries=0)
        agent = Agent(
            name="places",
            instructions="Record the place.",
            model=OpenAIChatCompletionsModel(model=model, openai_client=client),
            tools=[record_place],
            tool_use_behavior="stop_on_first_tool",  # the tool's result ends the run
            model_settings=ModelSettings(max_tokens=DEFAULT_MAX_TOKENS, tool_choice="record_place"),
        )
        try:
            plain = await Runner.run(agent, EXTRACT, max_turns=2)
            streamed = Runner.run_streamed(agent, EXTRACT, max_turns=2)
            async for _ in streamed.stream_events():
                pass
            return [plain, streamed]
        finally:
            await client.close()

    for result in asyncio.run(run()):
        calls = [i for i in result.new_items if i.type == "tool_call_item"]
        assert len(calls) == 1 and result.final_output == "recorded"
        _only_place_keys(json.loads(calls[0].raw_item.arguments)["place"])
    assert len(recorded) == 2


@pytest.mark.parametrize("parallel", [None, False], ids=["defaults", "parallel-off"])
def test_pydantic_ai_tool_output_at_default_sampling(
    server: LiveServer, model: str, parallel: bool | None
) -> None:
    """The output arrives as pydantic-ai's output tool under tool_choice required: with its
    defaults parallel calls are allowed (and the small model may make several, each valid);
    with them off, one call ends the turn."""
    from openai import AsyncOpenAI
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelResponse, ToolCallPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    settings = ModelSettings(max_tokens=DEFAULT_MAX_TOKENS)
    if parallel is not None:
        settings["parallel_tool_calls"] = parallel

    async def run() -> tuple[Any, Place]:
        client = AsyncOpenAI(base_url=server.api, api_key="dummy", max_retries=0)
        chat = OpenAIChatModel(model, provider=OpenAIProvider(openai_client=client))
        agent = Agent(chat, output_type=Place, model_settings=settings)
        try:
            plain = await agent.run(EXTRACT)
            async with agent.run_stream(EXTRACT) as streamed:
                return plain, await streamed.get_output()
        finally:
            await client.close()

    plain, streamed = asyncio.run(run())
    (response,) = [m for m in plain.all_messages() if isinstance(m, ModelResponse)]
    calls = [p for p in response.parts if isinstance(p, ToolCallPart)]
    for call in calls:
        _only_place_keys(call.args_as_dict())
    if parallel is False:
        assert len(calls) == 1 and response.finish_reason == "tool_call"
    _only_place_keys(plain.output.model_dump())
    _only_place_keys(streamed.model_dump())
