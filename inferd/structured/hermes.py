"""The Hermes tool-call syntax: how tools are offered to a model, how it writes a call, the
grammar that holds it to valid calls, and an incremental reader of its output.

A call is ``<tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>``; several follow
each other on new lines. The grammar's JSON has fixed spacing (one space after ``:`` and
``,``, no newline), so ``}\\n</tool_call>`` can only close a call: a JSON string cannot hold a
raw newline. That makes reading a stream exact without a JSON parser on partial text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from inferd.structured.constraint import Constraint

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_BODY_END = "}\n" + CLOSE
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    description: str
    parameters: Mapping[str, Any]  # a JSON schema, already checked


def system_block(tools: Sequence[ToolSpec]) -> str:
    """The generic instructions that offer ``tools`` (for templates that take no ``tools``)."""
    listed = "\n".join(
        json.dumps(
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.parameters,
                },
            },
            ensure_ascii=False,
        )
        for t in tools
    )
    return (
        "# Tools\n\nYou can call these functions to help answer. Their signatures, one per "
        f"line, inside <tools></tools>:\n<tools>\n{listed}\n</tools>\n\n"
        "To call a function, write a JSON object with its name and arguments between "
        f'{OPEN} and {CLOSE} tags:\n{OPEN}\n{{"name": <function name>, "arguments": '
        f"<arguments as a JSON object>}}\n{CLOSE}"
    )


def call_text(name: str, arguments: str) -> str:
    """A call as the model writes it (for assistant turns in the history)."""
    try:
        args = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        args = arguments  # shown as it was sent
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def calls_constraint(
    tools: Sequence[ToolSpec], *, parallel: bool, lazy: bool, answer: Any = None
) -> Constraint:
    """Output that is one call (or, ``parallel``, several) to one of ``tools``. ``lazy``: free
    text until the model opens a call, then only valid calls and nothing after them.
    ``answer`` (with ``lazy``): a JSON schema the text must follow when the model answers
    instead of calling (tool_choice auto beside response_format), so the output is one or the
    other, each valid, from its first token."""
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": t.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = {"anyOf": variants, "x-guidance": _JSON_LAYOUT}
    repeat = ' ("\\n" call)*' if parallel else ""
    lark = (
        f"start: call{repeat}\n"
        f'call: "{OPEN}\\n" body "\\n{CLOSE}"\n'
        f"body: %json {json.dumps(schema, ensure_ascii=False)}\n"
    )
    if lazy and answer is not None:
        lark = lark.replace("start:", "calls:", 1)
        answer_text = json.dumps(answer, ensure_ascii=False)
        return Constraint.lark(f"start: calls | answer\nanswer: %json {answer_text}\n{lark}")
    return Constraint.lark(lark, trigger=OPEN if lazy else "")


@dataclass(frozen=True, slots=True)
class CallPiece:
    """What one step of output adds to a tool call: its name once it is known, then pieces
    of its arguments' JSON text."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class CallReader:
    """Splits a model's output, as it streams, into content text and tool-call pieces.

    Content is released as it comes, except a tail that could be the start of ``<tool_call>``;
    inside a call, the name is released once whole and the arguments as they grow, less a
    tail that could be the start of the closing ``}\\n</tool_call>``.
    """

    buffer: str = ""
    in_call: bool = False
    calls: int = 0  # calls opened so far
    name_known: bool = False
    args_released: int = 0  # characters of the current body already released as arguments
    after_call: bool = False  # the newline between two calls is not content
    names: list[str] = field(default_factory=list)
    arguments: list[str] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[CallPiece]]:
        self.buffer += text
        content = ""
        pieces: list[CallPiece] = []
        while True:
            if not self.in_call:
                if self.after_call and self.buffer:
                    self.buffer = self.buffer.removeprefix("\n")
                    self.after_call = False
                at = self.buffer.find(OPEN)
                if at < 0:
                    keep = _partial_suffix(self.buffer, OPEN)
                    cut = len(self.buffer) - keep
                    content += self.buffer[:cut]
                    self.buffer = self.buffer[cut:]
                    return content, pieces
                content += self.buffer[:at]
                self.buffer = self.buffer[at + len(OPEN) :]
                self.in_call, self.name_known, self.args_released = True, False, 0
                self.calls += 1
                self.arguments.append("")
                continue
            piece, closed = self._in_call()
            if piece is not None:
                pieces.append(piece)
            if not closed:
                return content, pieces
            self.in_call = False

    def finish(self) -> str:
        """What is left unreleased at the end (a partial tag, or a call cut short)."""
        rest, self.buffer = self.buffer, ""
        return rest if not self.in_call else ""

    def _in_call(self) -> tuple[CallPiece | None, bool]:
        index = self.calls - 1
        name = None
        if not self.name_known:
            head = '\n{"name": '
            if not self.buffer.startswith(head) or '", "arguments": ' not in self.buffer:
                return None, False
            raw, _ = self.buffer[len(head) :].split(', "arguments": ', 1)
            name = json.loads(raw)
            self.names.append(name)
            self.name_known = True
            self.buffer = self.buffer[len(head) + len(raw) + len(', "arguments": ') :]
        end = self.buffer.find(_BODY_END)
        if end >= 0:
            args = self.buffer[self.args_released : end]
            self.buffer = self.buffer[end + len(_BODY_END) :]
            self.after_call = True
            self.arguments[index] += args
            return CallPiece(index, name, args), True
        safe = len(self.buffer) - _partial_suffix(self.buffer, _BODY_END)
        args = self.buffer[self.args_released : safe]
        self.args_released = max(self.args_released, safe)
        self.arguments[index] += args
        if name is None and not args:
            return None, False
        return CallPiece(index, name, args), False


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
