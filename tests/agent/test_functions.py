"""Python functions registered as tools (embedding): schemas, calls, and failures as results."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from inferd.agent.functions import FunctionTools, schema_from_signature
from inferd.agent.toolbox import ToolBox
from inferd.agent.tools import CallLimits


def make_tools() -> FunctionTools:
    tools = FunctionTools(limits=CallLimits(timeout_s=1.0, max_output_bytes=512))

    @tools.tool(permission="allow")
    def capital(country: str, upper: bool = False) -> str:
        """The capital city of a country."""
        city = {"france": "Paris", "japan": "Tokyo"}[country.lower()]
        return city.upper() if upper else city

    @tools.tool(description="Sum of some numbers")
    async def total(values: list[float], start: float | None = None) -> dict[str, float]:
        return {"total": sum(values) + (start or 0)}

    async def sleeper() -> str:
        await asyncio.sleep(30)
        return "late"

    tools.register(sleeper, schema={"type": "object", "properties": {}})
    tools.register(lambda: "a" * 2000, name="chatty", schema={"type": "object"})
    return tools


def calls(*pairs: tuple[str, dict[str, Any]]) -> list[Any]:
    async def main() -> list[Any]:
        box = ToolBox([make_tools()])
        await box.start()
        return [await box.call(name, args) for name, args in pairs]

    return asyncio.run(main())


def test_registered_functions_are_listed_with_schemas_from_their_signatures() -> None:
    tools = {t.name: t for t in make_tools().tools()}
    assert set(tools) == {"capital", "total", "sleeper", "chatty"}
    assert tools["capital"].description == "The capital city of a country."
    assert tools["capital"].input_schema == {
        "type": "object",
        "properties": {"country": {"type": "string"}, "upper": {"type": "boolean"}},
        "required": ["country"],
    }
    assert tools["capital"].permission == "allow" and tools["total"].permission == "ask"
    assert tools["total"].input_schema["properties"] == {
        "values": {"type": "array"},
        "start": {"type": "number"},
    }
    assert tools["total"].openai_tool()["function"]["description"] == "Sum of some numbers"


def test_sync_and_async_functions_answer_strings_as_is_and_the_rest_as_json() -> None:
    sync, async_, upper = calls(
        ("capital", {"country": "Japan"}),
        ("total", {"values": [1, 2.5], "start": 1}),
        ("capital", {"country": "france", "upper": True}),
    )
    assert (sync.content, sync.is_error) == ("Tokyo", False)
    assert async_.content == '{"total": 4.5}'
    assert upper.content == "PARIS"


def test_failures_timeouts_bad_arguments_and_big_answers_are_results() -> None:
    raised, slow, bad, big = calls(
        ("capital", {"country": "Atlantis"}),
        ("sleeper", {}),
        ("capital", {"city": "x"}),
        ("chatty", {}),
    )
    assert raised.is_error and raised.content == "the tool capital failed: KeyError"
    assert slow.is_error and "did not answer within 1 s" in slow.content
    assert bad.is_error and "bad arguments for capital" in bad.content
    assert big.truncated and big.content.startswith("a" * 512 + "\n[tool output truncated")


def test_a_duplicate_name_or_an_unschematic_signature_is_refused() -> None:
    tools = make_tools()
    with pytest.raises(ValueError, match="already registered"):
        tools.register(lambda: "", name="capital")

    def takes_object(thing: object) -> str:
        return ""

    with pytest.raises(ValueError, match="pass schema="):
        schema_from_signature(takes_object)
