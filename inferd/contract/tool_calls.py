"""Streamed tool calls, assembled strictly: each call whole and its arguments valid JSON.

A chat stream sends a tool call in pieces: the first delta of an index names the call (``id``,
``type: "function"``, ``function.name``), the next ones add fragments of ``function.arguments``.
A consumer that concatenates fragments without checking can end up with ``{"a": 1}{"a": 1}``
(two calls appended to one index) and hand a tool invalid JSON. The rules here:

- indices start at 0 and each new one is the next, with no gap; fragments of open calls may
  interleave, but an index is opened once, by the delta naming its call;
- a call's id and name are given once, when it opens, and never changed after;
- arguments are strings, bounded in total, and at the end each call's arguments parse as one
  JSON object (duplicate keys, NaN and trailing data refused).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
MAX_ARGUMENT_BYTES = 1 << 20


class ToolCallError(ValueError):
    """A streamed tool call that breaks the rules above; the message says which."""


@dataclass(frozen=True)
class ToolCall:
    index: int
    id: str
    name: str
    arguments: dict[str, Any]


class ToolCallAssembler:
    def __init__(self, max_argument_bytes: int = MAX_ARGUMENT_BYTES) -> None:
        self._calls: list[tuple[str, str, list[str]]] = []  # id, name, argument fragments
        self._bytes = 0
        self._max = max_argument_bytes

    def add(self, delta: object) -> None:
        """One entry of a delta's ``tool_calls`` list."""
        if not isinstance(delta, dict):
            raise ToolCallError("a tool_calls entry must be an object")
        index = delta.get("index")
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ToolCallError("a tool_calls entry needs a non-negative integer index")
        function = delta.get("function") or {}
        if not isinstance(function, dict):
            raise ToolCallError(f"call {index}: function must be an object")
        if index == len(self._calls):
            self._open(index, delta, function)
        elif index > len(self._calls):
            raise ToolCallError(f"call {index} before call {len(self._calls)}")
        elif "id" in delta or "name" in function:
            raise ToolCallError(f"call {index} was named once already")
        fragment = function.get("arguments", "")
        if not isinstance(fragment, str):
            raise ToolCallError(f"call {index}: arguments must be a string")
        self._bytes += len(fragment.encode("utf-8"))
        if self._bytes > self._max:
            raise ToolCallError(f"tool call arguments over {self._max} bytes")
        self._calls[index][2].append(fragment)

    def _open(self, index: int, delta: dict[str, Any], function: dict[str, Any]) -> None:
        call_id, name = delta.get("id"), function.get("name")
        if not isinstance(call_id, str) or not call_id:
            raise ToolCallError(f"call {index} opens without an id")
        if delta.get("type") != "function":
            raise ToolCallError(f"call {index}: type must be function")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ToolCallError(f"call {index} opens without a valid function name")
        self._calls.append((call_id, name, []))

    @property
    def started(self) -> bool:
        return bool(self._calls)

    def finish(self) -> tuple[ToolCall, ...]:
        """The whole calls; ToolCallError if any call's arguments are not one JSON object."""
        calls = []
        for index, (call_id, name, fragments) in enumerate(self._calls):
            text = "".join(fragments)
            try:
                value = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_nan)
            except ValueError as exc:
                raise ToolCallError(
                    f"call {index} ({name}): arguments are not JSON: {exc}"
                ) from None
            if not isinstance(value, dict):
                raise ToolCallError(f"call {index} ({name}): arguments must be a JSON object")
            calls.append(ToolCall(index, call_id, name, value))
        return tuple(calls)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("a key appears twice")
    return dict(pairs)


def _nan(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
