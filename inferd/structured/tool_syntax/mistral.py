"""The Mistral tool-call syntax: ``[TOOL_CALLS][{"name": "NAME", "arguments": {...}}, ...]``,
or the newer form (templates that write ``[ARGS]``), ``[TOOL_CALLS]NAME[ARGS]{...}`` once per
call. Both are read; the grammar writes the form the template uses.

In Mistral's own tokenizers ``[TOOL_CALLS]`` is a control token, which the detokenizer drops
from the text (and a grammar's text cannot produce), so the list form also starts at its
``[{"name": `` and the grammar leaves the marker optional.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from inferd.structured.tool_syntax.base import (
    Cursor,
    Diverged,
    ParsedCall,
    ToolSpec,
    arguments_value,
    call_variants,
    json_rule,
    read_arguments,
    read_calls,
    tools_listing,
)

CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
LIST = '[{"name": '


@dataclass(frozen=True, slots=True)
class Mistral:
    name: str = "mistral"
    named_form: bool = False  # NAME[ARGS]{...} rather than a JSON list

    @property
    def starts(self) -> tuple[str, ...]:
        return (CALLS,) if self.named_form else (CALLS, LIST)

    def triggers(self, tools: Sequence[ToolSpec]) -> tuple[str, ...]:
        return self.starts

    def system_block(self, tools: Sequence[ToolSpec]) -> str:
        form = (
            f"{CALLS}<function name>{ARGS}<arguments as a JSON object>"
            if self.named_form
            else f'{CALLS}[{{"name": <function name>, "arguments": <arguments as a JSON object>}}]'
        )
        return (
            "# Tools\n\nYou can call these functions to help answer. Their signatures, one per "
            f"line:\n{tools_listing(tools)}\n\nTo call a function, write:\n{form}"
        )

    def calls_text(self, calls: Sequence[tuple[str, str]]) -> str:
        if self.named_form:
            return "".join(
                f"{CALLS}{n}{ARGS}{json.dumps(arguments_value(a), ensure_ascii=False)}"
                for n, a in calls
            )
        listed = [{"name": n, "arguments": arguments_value(a)} for n, a in calls]
        return CALLS + json.dumps(listed, ensure_ascii=False)

    def grammar(self, tools: Sequence[ToolSpec], parallel: bool) -> str:
        if self.named_form:
            repeat = "+" if parallel else ""
            alternatives = " | ".join(f"call_{i}" for i in range(len(tools)))
            rules = "".join(
                f'call_{i}: "{CALLS}{t.name}{ARGS}" {json_rule(t.arguments_schema)}\n'
                for i, t in enumerate(tools)
            )
            return f"calls: call{repeat}\ncall: {alternatives}\n{rules}"
        repeat = ' (", " call)*' if parallel else ""
        return (
            f'calls: "{CALLS}"? "[" call{repeat} "]"\n'
            f"call: {json_rule(call_variants(tools, 'arguments'))}\n"
        )

    def parse(self, cursor: Cursor) -> list[ParsedCall] | None:
        cursor.pos = len(CALLS) if cursor.text.startswith(CALLS) else 0
        if cursor.text[cursor.pos : cursor.pos + 1] == "[":
            cursor.pos += 1
            return read_calls(cursor, _read_listed)
        return read_calls(cursor, _read_named)


def _read_listed(cursor: Cursor, calls: list[ParsedCall]) -> bool:
    cursor.spaces()
    if calls:
        if cursor.maybe("]"):
            return False
        cursor.literal(",")
        cursor.spaces()
    cursor.literal('{"name": ')
    name = cursor.json_string()
    cursor.literal(', "arguments": ')
    arguments = read_arguments(cursor, name, calls)
    if arguments is None:
        return False
    cursor.spaces()
    cursor.literal("}")
    calls[-1] = ParsedCall(name, arguments, True)
    return True


def _read_named(cursor: Cursor, calls: list[ParsedCall]) -> bool:
    if calls:
        cursor.spaces()
        if cursor.at_end:
            return False
        cursor.literal(CALLS)
    name = cursor.word(ARGS)
    calls.append(ParsedCall(name, "", False))
    arguments, done = cursor.value()
    if arguments and not arguments.startswith("{"):
        raise Diverged
    calls[-1] = ParsedCall(name, arguments, done)
    return done
