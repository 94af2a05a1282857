"""Tools that the live tool-calling tests offer, and the checks every returned call must pass."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import openai

ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def weather_and_time(max_length: int) -> tuple[dict[str, Any], list[Any]]:
    """Two tools' argument schemas by name, and the tools as chat requests list them; strings
    are bounded by ``max_length`` so a 135M model's arguments end within the token budget."""
    city = {"type": "string", "maxLength": max_length}
    schemas = {
        "get_weather": {
            "type": "object",
            "properties": {"city": city, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
        "get_time": {
            "type": "object",
            "properties": {"timezone": city},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    }
    tools = [
        {
            "type": "function",
            "function": {"name": n, "description": f"{n} of a place", "parameters": p},
        }
        for n, p in schemas.items()
    ]
    return schemas, tools


def check_calls(calls: Any, schemas: dict[str, Any], names: frozenset[str] | None = None) -> None:
    """At least one call; each a function call with an id, a name offered (from ``names`` when
    given) and arguments valid against that tool's schema."""
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in (schemas if names is None else names)
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@dataclass
class StreamedReply:
    """A streamed chat reply put back together."""

    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments) in order
    finishes: list[str] = field(default_factory=list)


def streamed_reply(client: openai.OpenAI, kwargs: dict[str, Any]) -> StreamedReply:
    """Stream a one-choice chat request; a call's first delta carries its id, type and name
    once, later deltas only more arguments."""
    out, names, ids, args = StreamedReply(), {}, {}, {}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        (choice,) = chunk.choices
        out.content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            assert delta.function is not None
            if delta.id is not None:
                assert delta.index not in ids and delta.type == "function"
                assert delta.function.name
                ids[delta.index], names[delta.index] = delta.id, delta.function.name
            else:
                assert delta.function.name is None and delta.index in ids
            args[delta.index] = args.get(delta.index, "") + (delta.function.arguments or "")
        if choice.finish_reason is not None:
            out.finishes.append(choice.finish_reason)
    out.calls = [(names[i], args[i]) for i in sorted(names)]
    return out
