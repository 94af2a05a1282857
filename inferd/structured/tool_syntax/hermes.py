"""The Hermes tool-call syntax (Qwen2/Qwen3, Hermes, and inferd's generic block).

A call is ``<tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>``; several follow
each other on new lines.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from inferd.structured.tool_syntax.base import (
    Cursor,
    ParsedCall,
    ToolSpec,
    arguments_value,
    call_variants,
    json_rule,
    read_arguments,
    read_calls,
    tools_listing,
)

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


def call_text(name: str, arguments: str) -> str:
    """A call as the model writes it (for assistant turns in the history)."""
    body = json.dumps({"name": name, "arguments": arguments_value(arguments)}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


@dataclass(frozen=True, slots=True)
class Hermes:
    name: str = "hermes"
    starts: tuple[str, ...] = (OPEN,)

    def triggers(self, tools: Sequence[ToolSpec]) -> tuple[str, ...]:
        return self.starts

    def system_block(self, tools: Sequence[ToolSpec]) -> str:
        return (
            "# Tools\n\nYou can call these functions to help answer. Their signatures, one per "
            f"line, inside <tools></tools>:\n<tools>\n{tools_listing(tools)}\n</tools>\n\n"
            "To call a function, write a JSON object with its name and arguments between "
            f'{OPEN} and {CLOSE} tags:\n{OPEN}\n{{"name": <function name>, "arguments": '
            f"<arguments as a JSON object>}}\n{CLOSE}"
        )

    def calls_text(self, calls: Sequence[tuple[str, str]]) -> str:
        return "\n".join(call_text(name, args) for name, args in calls)

    def grammar(self, tools: Sequence[ToolSpec], parallel: bool) -> str:
        repeat = ' ("\\n" call)*' if parallel else ""
        return (
            f"calls: call{repeat}\n"
            f'call: "{OPEN}\\n" body "\\n{CLOSE}"\n'
            f"body: {json_rule(call_variants(tools, 'arguments'))}\n"
        )

    def parse(self, cursor: Cursor) -> list[ParsedCall] | None:
        return read_calls(cursor, _read_one)


def _read_one(cursor: Cursor, calls: list[ParsedCall]) -> bool:
    if calls:
        cursor.spaces()
        if cursor.at_end:
            return False
    cursor.literal(OPEN)
    cursor.spaces()
    cursor.literal('{"name": ')
    name = cursor.json_string()
    cursor.literal(', "arguments": ')
    arguments = read_arguments(cursor, name, calls)
    if arguments is None:
        return False
    cursor.literal("}")
    cursor.spaces()
    cursor.literal(CLOSE)
    calls[-1] = ParsedCall(name, arguments, True)
    return True
