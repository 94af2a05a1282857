"""The pythonic tool-call syntax (Llama 4, some Llama 3.2 templates): the reply is a Python
list of calls, ``[get_weather(city="Paris"), ping()]``.

The lazy grammar triggers on ``[NAME(`` for each tool, so brackets in plain text stay free.
Arguments stream as JSON: ``{`` once the call opens, each keyword argument once its value is
whole (Python literals such as ``True`` or ``'x'`` become JSON), ``}`` at the ``)``.

The grammar writes each keyword argument's value as JSON held to that property's schema, so it
needs the plain shape of a tool's parameters: an object schema with ``properties`` (and
``required``, ``additionalProperties``, ``$defs``, words for people); anything else is refused
when the request is checked, as a constraint error.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from inferd.structured.errors import ConstraintError
from inferd.structured.tool_syntax.base import (
    Cursor,
    Diverged,
    ParsedCall,
    Partial,
    ToolSpec,
    arguments_value,
    json_rule,
    read_calls,
    tools_listing,
)

_PLAIN_KEYS = frozenset(
    {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "$defs",
        "definitions",
        "$schema",
        "title",
        "description",
        "$comment",
    }
)


@dataclass(frozen=True, slots=True)
class Pythonic:
    name: str = "pythonic"
    starts: tuple[str, ...] = ("[",)

    def triggers(self, tools: Sequence[ToolSpec]) -> tuple[str, ...]:
        return tuple(f"[{t.name}(" for t in tools)

    def system_block(self, tools: Sequence[ToolSpec]) -> str:
        return (
            "# Tools\n\nYou can call these functions to help answer. Their signatures, one per "
            f"line:\n{tools_listing(tools)}\n\nTo call functions, reply with only a Python "
            "list of calls with keyword arguments: [func_name1(param1=value1, param2=value2), "
            "func_name2(param=value)]"
        )

    def calls_text(self, calls: Sequence[tuple[str, str]]) -> str:
        return "[" + ", ".join(_call_text(n, a) for n, a in calls) + "]"

    def grammar(self, tools: Sequence[ToolSpec], parallel: bool) -> str:
        repeat = ' (", " call)*' if parallel else ""
        alternatives = " | ".join(f"call_{i}" for i in range(len(tools)))
        rules = "".join(_tool_rules(i, t) for i, t in enumerate(tools))
        return f'calls: "[" call{repeat} "]"\ncall: {alternatives}\n{rules}'

    def parse(self, cursor: Cursor) -> list[ParsedCall] | None:
        cursor.literal("[")
        return read_calls(cursor, _read_one)


def _call_text(name: str, arguments: str) -> str:
    value = arguments_value(arguments)
    if not isinstance(value, Mapping):
        return f"{name}({arguments})"
    args = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in value.items())
    return f"{name}({args})"


def _tool_rules(index: int, tool: ToolSpec) -> str:
    """``call_i``: the tool's name and its keyword arguments in the schema's order, required
    ones always, optional ones maybe: ``head_j`` starts at argument j with no comma before it,
    ``tail_j`` puts a comma before each argument from j on."""
    params = tool.arguments_schema
    extra = set(params) - _PLAIN_KEYS
    if params.get("type", "object") != "object" or extra:
        raise ConstraintError(
            f"the pythonic tool-call syntax takes parameters that are an object schema with "
            f"properties; {tool.name!r} has {', '.join(sorted(extra)) or params.get('type')}",
            "tools",
        )
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    props: Mapping[str, Any] = params.get("properties", {})
    for key in props:
        if not key.isidentifier():
            raise ConstraintError(
                f"the pythonic tool-call syntax writes arguments as keywords; {tool.name!r} has "
                f"a property {key!r} that is not a Python identifier",
                "tools",
            )
    required = set(params.get("required", ()))
    names = list(props)
    p = f"t{index}"
    lines = [f'call_{index}: "{tool.name}(" {p}_head_0 ")"\n']
    for j, key in enumerate(names):
        schema = props[key] if not isinstance(props[key], Mapping) else {**defs, **props[key]}
        lines.append(f'{p}_arg_{j}: "{key}=" {json_rule(schema)}\n')
    n = len(names)
    lines.append(f'{p}_head_{n}: ""\n{p}_tail_{n}: ""\n')
    for j in range(n - 1, -1, -1):
        arg = f"{p}_arg_{j}"
        if names[j] in required:
            lines.append(f"{p}_head_{j}: {arg} {p}_tail_{j + 1}\n")
            lines.append(f'{p}_tail_{j}: ", " {arg} {p}_tail_{j + 1}\n')
        else:
            lines.append(f"{p}_head_{j}: {arg} {p}_tail_{j + 1} | {p}_head_{j + 1}\n")
            lines.append(f'{p}_tail_{j}: (", " {arg})? {p}_tail_{j + 1}\n')
    return "".join(lines)


def _read_one(cursor: Cursor, calls: list[ParsedCall]) -> bool:
    cursor.spaces()
    if calls:
        if cursor.maybe("]"):
            return False
        cursor.literal(",")
        cursor.spaces()
    name = cursor.word("(")
    calls.append(ParsedCall(name, "{", False))
    parts: list[str] = []
    while True:
        cursor.spaces()
        if cursor.maybe(")"):
            calls[-1] = ParsedCall(name, "{" + ", ".join(parts) + "}", True)
            return True
        if parts:
            cursor.literal(",")
            cursor.spaces()
            if cursor.maybe(")"):  # a trailing comma
                calls[-1] = ParsedCall(name, "{" + ", ".join(parts) + "}", True)
                return True
        key = cursor.word("=")
        text, done = cursor.value()
        if not done:
            raise Partial
        parts.append(f"{json.dumps(key)}: {_as_json(text)}")
        calls[-1] = ParsedCall(name, "{" + ", ".join(parts), False)


def _as_json(text: str) -> str:
    """A keyword argument's value (JSON, or a Python literal) as JSON text."""
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except json.JSONDecodeError:
        pass
    try:
        return json.dumps(ast.literal_eval(text.strip()), ensure_ascii=False)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise Diverged from None
