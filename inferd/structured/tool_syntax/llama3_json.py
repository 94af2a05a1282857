"""The Llama 3.x JSON tool-call syntax: the reply is ``{"name": "NAME", "parameters": {...}}``,
maybe after ``<|python_tag|>``; several calls are separated by ``; ``.

Calls start at the JSON object itself, so the lazy grammar triggers on ``{"name": `` (or the
tag): a reply that opens with that object is a call.
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

TAG = "<|python_tag|>"
HEAD = '{"name": '
SEPARATOR = "; "


@dataclass(frozen=True, slots=True)
class Llama3Json:
    name: str = "llama3_json"
    starts: tuple[str, ...] = (TAG, HEAD)

    def triggers(self, tools: Sequence[ToolSpec]) -> tuple[str, ...]:
        return self.starts

    def system_block(self, tools: Sequence[ToolSpec]) -> str:
        return (
            "# Tools\n\nYou can call these functions to help answer. Their signatures, one per "
            f"line:\n{tools_listing(tools)}\n\n"
            "To call a function, reply with only a JSON object with its name and parameters: "
            '{"name": <function name>, "parameters": <arguments as a JSON object>}'
        )

    def calls_text(self, calls: Sequence[tuple[str, str]]) -> str:
        return SEPARATOR.join(
            json.dumps({"name": n, "parameters": arguments_value(a)}, ensure_ascii=False)
            for n, a in calls
        )

    def grammar(self, tools: Sequence[ToolSpec], parallel: bool) -> str:
        repeat = f' ("{SEPARATOR}" call)*' if parallel else ""
        return (
            f'calls: "{TAG}"? call{repeat}\ncall: {json_rule(call_variants(tools, "parameters"))}\n'
        )

    def parse(self, cursor: Cursor) -> list[ParsedCall] | None:
        if cursor.text.startswith(TAG):
            cursor.pos = len(TAG)
        return read_calls(cursor, _read_one)


def _read_one(cursor: Cursor, calls: list[ParsedCall]) -> bool:
    if calls:
        if cursor.at_end:
            return False
        cursor.literal(";")
    cursor.spaces()
    cursor.literal(HEAD)
    name = cursor.json_string()
    cursor.literal(", ")
    for key in ('"parameters": ', '"arguments": '):  # models write either
        if cursor.maybe(key):
            break
    else:
        cursor.literal('"parameters": ')
    arguments = read_arguments(cursor, name, calls)
    if arguments is None:
        return False
    cursor.spaces()
    cursor.literal("}")
    calls[-1] = ParsedCall(name, arguments, True)
    return True
