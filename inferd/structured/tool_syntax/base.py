"""What every tool-call syntax shares: the tools offered, the pieces a call streams in, a
cursor that reads a model's partial output, and one reader that turns output into content and
call pieces as it streams, whatever the family.

A family (hermes.py, llama3_json.py, mistral.py, pythonic.py) says where its calls start
(``starts``: the markers the lazy grammar also triggers on) and how to read the calls that
follow (``parse``: called on the text from the marker on, as it grows). The reader releases
content up to a marker, then diffs each parse against what it has released, so a call's name
goes out once, whole, and its arguments in pieces that only ever grow.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from inferd.structured.constraint import Constraint
from inferd.structured.tool_syntax.arguments import closed, has_refs, rebased

# Fixed JSON spacing in grammars: one space after ``:`` and ``,``, never a newline, so a raw
# newline or a family's marker can only come after a call, never inside one.
_WORD = re.compile(r"[A-Za-z0-9_.-]")
_IN_STRING = re.compile(r"[^\\\"']+")  # nothing that escapes or may close a string
_OUTSIDE = re.compile(r"[^\\\"'{}\[\]();,\n]+")  # nothing that opens, closes or ends a value
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    description: str
    parameters: Mapping[str, Any]  # a JSON schema, already checked
    strict: bool = True  # objects that list properties take no other keys (arguments.py)

    @property
    def arguments_schema(self) -> Any:
        """What a call's arguments are held to: ``parameters``, closed unless not strict."""
        return closed(self.parameters) if self.strict else self.parameters


@dataclass(frozen=True, slots=True)
class CallPiece:
    """What one step of output adds to a tool call: its name once it is known, then pieces
    of its arguments' JSON text."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """A call as far as the output shows it: ``arguments`` is JSON text that later output
    only extends; ``closed`` once the family's syntax has ended the call."""

    name: str
    arguments: str
    closed: bool


class ToolSyntax(Protocol):
    """One family's syntax: the prompt side, the grammar, and the reader's half."""

    @property
    def name(self) -> str:
        """The syntax's name, as --tool-call-parser takes it."""
        ...

    @property
    def starts(self) -> tuple[str, ...]:
        """What opens the calls in free text."""
        ...

    def triggers(self, tools: Sequence[ToolSpec]) -> tuple[str, ...]:
        """What opens a call to one of ``tools`` (the lazy grammar's triggers, the reader's
        markers): ``starts``, or narrower where a start alone is common in plain text."""
        ...

    def system_block(self, tools: Sequence[ToolSpec]) -> str:
        """The generic instructions offering ``tools`` (templates that take no ``tools``)."""
        ...

    def calls_text(self, calls: Sequence[tuple[str, str]]) -> str:
        """Calls (name, arguments JSON) as the model writes them, for history turns."""
        ...

    def grammar(self, tools: Sequence[ToolSpec], parallel: bool) -> str:
        """Lark rules whose ``calls`` rule is one call (or, ``parallel``, several), from the
        family's start marker on."""
        ...

    def parse(self, cursor: Cursor) -> list[ParsedCall] | None:
        """The calls in the cursor's text (from a start marker on, maybe cut short); None when
        the text is not a call after all (it diverged before any name was whole)."""
        ...


def calls_constraint(
    syntax: ToolSyntax,
    tools: Sequence[ToolSpec],
    *,
    parallel: bool,
    lazy: bool,
    answer: Any = None,
) -> Constraint:
    """Output that is one call (or, ``parallel``, several) to one of ``tools``. ``lazy``: free
    text until the model starts a call, then only valid calls and nothing after them.
    ``answer`` (with ``lazy``): a JSON schema the text must follow when the model answers
    instead of calling, so the output is one or the other, each valid, from its first token."""
    rules = syntax.grammar(tools, parallel)
    if lazy and answer is not None:
        answer_text = json.dumps(answer, ensure_ascii=False)
        return Constraint.lark(f"start: calls | answer\nanswer: %json {answer_text}\n{rules}")
    triggers = syntax.triggers(tools) if lazy else ()
    return Constraint.lark(f"start: calls\n{rules}", triggers=triggers)


def json_rule(schema: Any) -> str:
    """A Lark ``%json`` body holding JSON to ``schema`` with the fixed layout."""
    if isinstance(schema, Mapping):
        schema = {**schema, "x-guidance": JSON_LAYOUT}
    return f"%json {json.dumps(schema, ensure_ascii=False)}"


def call_variants(tools: Sequence[ToolSpec], args_key: str) -> dict[str, Any]:
    """A schema matching ``{"name": NAME, args_key: ARGS}`` for any of ``tools``. A tool's
    arguments schema that refers into itself (``#/$defs/...``) moves to ``#/$defs/tool_I``,
    its references rewritten to point there."""
    defs: dict[str, Any] = {}
    variants = []
    for i, tool in enumerate(tools):
        args = tool.arguments_schema
        if has_refs(args):
            defs[f"tool_{i}"] = rebased(args, f"/$defs/tool_{i}")
            args = {"$ref": f"#/$defs/tool_{i}"}
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, args_key: args},
                "required": ["name", args_key],
                "additionalProperties": False,
            }
        )
    return {"anyOf": variants, **({"$defs": defs} if defs else {})}


def tools_listing(tools: Sequence[ToolSpec]) -> str:
    """Tools as JSON lines, the way every generic block lists them."""
    return "\n".join(
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


def arguments_value(arguments: str) -> Any:
    """Arguments JSON text as a value (shown as sent when it is not JSON)."""
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return arguments


# -- reading partial output ------------------------------------------------------------------


class Partial(Exception):
    """The text ends before this part of the syntax is whole."""


class Diverged(Exception):
    """The text is not what the syntax expects here."""


@dataclass(slots=True)
class Cursor:
    """A place in a family's output. ``memo`` (shared by the reader across parses of a text
    that only grows) keeps where each value's scan stopped, so parsing again costs only the
    new text."""

    text: str
    pos: int = 0
    memo: dict[int, tuple[int, int, str, bool, bool]] = field(default_factory=dict)

    @property
    def at_end(self) -> bool:
        return self.pos >= len(self.text)

    def literal(self, expected: str) -> None:
        rest = self.text[self.pos : self.pos + len(expected)]
        if rest == expected:
            self.pos += len(expected)
            return
        if expected.startswith(rest):
            raise Partial
        raise Diverged

    def maybe(self, expected: str) -> bool:
        """Take ``expected`` if the text goes on with it; Partial while it might."""
        try:
            self.literal(expected)
        except Diverged:
            return False
        return True

    def spaces(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in " \t\r\n":
            self.pos += 1

    def word(self, end: str) -> str:
        """An identifier (letters, digits, ``_``, ``-``, ``.``) up to ``end``, which is taken."""
        start = self.pos
        while self.pos < len(self.text) and _WORD.fullmatch(self.text[self.pos]):
            self.pos += 1
        name = self.text[start : self.pos]
        if not name:
            if self.at_end:
                raise Partial
            raise Diverged
        self.literal(end)
        return name

    def json_string(self) -> str:
        text, done = self.value()
        if not done:
            raise Partial
        try:
            name = json.loads(text)
        except json.JSONDecodeError:
            raise Diverged from None
        if not isinstance(name, str):
            raise Diverged
        return name

    def value(self) -> tuple[str, bool]:
        """A JSON (or Python literal) value from here: the text so far, and whether it is
        whole. Strings, brackets and braces are tracked, so ``,`` ``}`` ``]`` ``)`` inside
        them do not end it; a scalar ends at the first of those outside them."""
        start, text = self.pos, self.text
        self.pos, depth, quote, escaped, done = self.memo.get(start, (start, 0, "", False, False))
        if done:
            return text[start : self.pos], True
        while self.pos < len(text):
            # Runs of characters that change nothing are skipped in one C-level step: the
            # reader parses its text again as it grows, so this keeps long arguments cheap.
            plain = None if escaped else (_IN_STRING if quote else _OUTSIDE).match(text, self.pos)
            if plain is not None:
                self.pos = plain.end()
                continue
            ch = text[self.pos]
            if quote:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == quote:
                    quote = ""
                    if depth == 0:
                        self.pos += 1
                        return self._whole(start)
            elif ch in "\"'":
                quote = ch
            elif ch in "{[(":
                depth += 1
            elif ch in "}])":
                if depth == 0:
                    if self.pos == start:
                        raise Diverged
                    return self._whole(start)
                depth -= 1
                if depth == 0:
                    self.pos += 1
                    return self._whole(start)
            elif ch in ",;\n" and depth == 0:
                if self.pos == start:
                    raise Diverged
                return self._whole(start)
            self.pos += 1
        self.memo[start] = (self.pos, depth, quote, escaped, False)
        return text[start : self.pos], False

    def _whole(self, start: int) -> tuple[str, bool]:
        self.memo[start] = (self.pos, 0, "", False, True)
        return self.text[start : self.pos], True


def read_calls(cursor: Cursor, read_one: Any) -> list[ParsedCall] | None:
    """Calls read by ``read_one(cursor, calls)`` (which appends to ``calls``, and returns
    False when no call follows) until the text ends or stops fitting the syntax."""
    calls: list[ParsedCall] = []
    try:
        while read_one(cursor, calls):
            pass
    except Partial:
        pass
    except Diverged:
        if not calls:
            return None
    return calls


def read_arguments(cursor: Cursor, name: str, calls: list[ParsedCall]) -> str | None:
    """The JSON arguments of the call ``name`` at the cursor, appended to ``calls`` (still
    open) as far as they are written; None while the value is unfinished."""
    calls.append(ParsedCall(name, "", False))
    arguments, done = cursor.value()
    calls[-1] = ParsedCall(name, arguments, False)
    return arguments if done else None


# -- the reader ------------------------------------------------------------------------------


@dataclass(slots=True)
class CallReader:
    """Splits a model's output, as it streams, into content text and tool-call pieces.

    Content is released as it comes, except a tail that could be the start of a call marker;
    from a marker on, the family's parse says which calls the text holds so far. ``most``: the
    calls the request allows (a named tool_choice, parallel calls off: one); the grammar already
    ends the output after them, and the reader ignores any beyond them whatever the grammar was.
    Each call is a new index, its pieces only ever extend it.
    """

    syntax: ToolSyntax
    starts: tuple[str, ...] = ()  # the markers to look for; the syntax's own when empty
    most: int | None = None  # the calls read at most; None: no bound
    buffer: str = ""  # content not yet released (a tail that could start a marker)
    section: str | None = None  # the output from the calls' marker on
    names: list[str] = field(default_factory=list)
    arguments: list[str] = field(default_factory=list)
    closed: int = 0  # calls the syntax has ended
    memo: dict[int, tuple[int, int, str, bool, bool]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.starts:
            self.starts = self.syntax.starts

    @property
    def calls(self) -> int:
        return len(self.names)

    @property
    def in_call(self) -> bool:
        return self.closed < len(self.names)

    def feed(self, text: str) -> tuple[str, list[CallPiece]]:
        if self.section is not None:
            self.section += text
            if self.names or self._parse() is not None:
                return "", self._pieces()
            # Not a call after all (``[`` opening plain text): read it again as content.
            self.buffer, self.section = self.section, None
            self.memo.clear()
        else:
            self.buffer += text
        content = ""
        while True:
            at, marker = _first_marker(self.buffer, self.starts)
            if at < 0:
                keep = max(_partial_suffix(self.buffer, m) for m in self.starts)
                cut = len(self.buffer) - keep
                content += self.buffer[:cut]
                self.buffer = self.buffer[cut:]
                return content, []
            content += self.buffer[:at]
            section = self.buffer[at:]
            if self.syntax.parse(Cursor(section)) is None:  # a marker in plain text: content
                content += section[: len(marker)]
                self.buffer = section[len(marker) :]
                continue
            self.section, self.buffer = section, ""
            return content, self._pieces()

    def finish(self) -> str:
        """What is left unreleased at the end (a partial marker)."""
        rest, self.buffer = self.buffer, ""
        return rest

    def _pieces(self) -> list[CallPiece]:
        parsed = (self._parse() or [])[: self.most]
        pieces: list[CallPiece] = []
        for index, call in enumerate(parsed):
            name = None
            if index >= len(self.names):
                name = call.name
                self.names.append(call.name)
                self.arguments.append("")
            grown = call.arguments[len(self.arguments[index]) :]
            self.arguments[index] = call.arguments
            if name is not None or grown:
                pieces.append(CallPiece(index, name, grown))
        self.closed = sum(1 for c in parsed if c.closed)
        return pieces

    def _parse(self) -> list[ParsedCall] | None:
        assert self.section is not None
        return self.syntax.parse(Cursor(self.section, memo=self.memo))


def _first_marker(text: str, markers: Sequence[str]) -> tuple[int, str]:
    found = [(text.find(m), m) for m in markers if m in text]
    return min(found) if found else (-1, "")


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
