"""OpenAI function tools on /v1/chat/completions: the request's ``tools``, ``tool_choice`` and
``parallel_tool_calls``, the tool turns of the history, and the calls in the response.

Tools are offered to the model the way its ``ToolFormat`` says (structured/tool_syntax): through
the chat template's ``tools`` variable when the template takes one, else in a generic system
block. Its output is constrained in the model's call syntax: with ``required`` or a named tool
the whole reply is one call (or several, with ``parallel_tool_calls``); with ``auto`` the reply
is free until the model opens a call, then the grammar holds, so every call it emits parses and
matches its tool's schema. ``none`` offers no tools and constrains nothing. In the history, an
assistant turn's ``tool_calls`` and the ``tool`` results are written back in the same format.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from inferd.server.errors import bad_request
from inferd.structured.constraint import Constraint, ConstraintError
from inferd.structured.tool_syntax import (
    CallPiece,
    CallReader,
    ToolFormat,
    ToolSpec,
    calls_constraint,
)
from inferd.structured.tool_syntax.base import arguments_value

MAX_TOOLS = 128
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


@dataclass(frozen=True, slots=True)
class ToolRequest:
    tools: tuple[ToolSpec, ...]
    choice: str  # none | auto | required | named
    named: str | None
    parallel: bool

    @property
    def active(self) -> bool:
        return self.choice != "none"

    @property
    def callable(self) -> list[ToolSpec]:
        return [t for t in self.tools if self.named is None or t.name == self.named]

    @property
    def one_call(self) -> bool:
        """Whether the reply makes exactly one call, then ends: a named tool is called once
        (what instructor and langchain's forced tools expect), and parallel calls off allow
        one of any tool."""
        return self.choice == "named" or not self.parallel

    def constraint(self, fmt: ToolFormat, answer: Any = None) -> Constraint | None:
        """What tool use holds the output to, in the model's syntax; ``answer``:
        response_format's schema for a text reply (only auto leaves room for one: required
        and named output a call). A 400 when the syntax cannot hold these tools."""
        if not self.active:
            return None
        auto = self.choice == "auto"
        try:
            return calls_constraint(
                fmt.syntax, self.callable, parallel=not self.one_call, lazy=auto, answer=answer
            )
        except ConstraintError as exc:
            raise bad_request(f"tools: {exc}", "tools") from None

    def reader(self, fmt: ToolFormat) -> CallReader:
        """A reader of the reply for calls to these tools."""
        return fmt.reader(self.callable, 1 if self.one_call else None)


def parse_tools(
    tools: list[Any] | None,
    choice: Any,
    parallel: bool | None,
    server: Sequence[ToolSpec] = (),
) -> ToolRequest | None:
    """The request's tools and how they may be used; None when it offers none. ``server``:
    the tools the server runs (agent_runtime.py), offered after the request's and open to
    ``tool_choice`` like them."""
    if not tools and not server:
        if choice not in (None, "none"):
            raise bad_request("tool_choice: the request offers no tools", "tool_choice")
        return None
    tools = tools or []
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    specs = tuple(_tool(i, t) for i, t in enumerate(tools))
    seen = {t.name for t in server}
    for i, spec in enumerate(specs):
        if spec.name in seen:
            param = f"tools.{i}.function.name"
            own = " (a server-side tool's name)" if spec.name in {t.name for t in server} else ""
            raise bad_request(f"{param}: duplicate tool name {spec.name!r}{own}", param)
        seen.add(spec.name)
    mode, named = _choice(choice, seen)
    return ToolRequest(specs + tuple(server), mode, named, True if parallel is None else parallel)


def _tool(index: int, tool: Any) -> ToolSpec:
    param = f"tools.{index}"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad_request(f"{param}: only tools of type 'function' are supported", f"{param}.type")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise bad_request(f"{param}.function is required", f"{param}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_request(
            f"{param}.function.name must be 1 to 64 letters, digits, _ or -",
            f"{param}.function.name",
        )
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise bad_request(
            f"{param}.function.description must be a string", f"{param}.function.description"
        )
    parameters = fn.get("parameters", {"type": "object", "properties": {}})
    where = f"{param}.function.parameters"
    try:
        Constraint.json_schema(parameters, param=where)  # checked like response_format schemas
    except ConstraintError as exc:
        raise bad_request(f"{where}: {exc}", where) from None
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{param}.function.strict must be a boolean", f"{param}.function.strict")
    # Arguments always follow the schema; strict (the default) also closes its objects to keys
    # it does not list, and only an explicit false keeps them open (tool_syntax/arguments.py).
    return ToolSpec(name, description, parameters, strict=strict is not False)


def _choice(choice: Any, names: set[str]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if choice in ("none", "auto", "required"):
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or name not in names:
            raise bad_request(
                f"tool_choice names the function {name!r}, which is not among the tools",
                "tool_choice",
            )
        return "named", name
    raise bad_request(
        "tool_choice must be none, auto, required or {type: function, function: {name}}",
        "tool_choice",
    )


# -- the history -----------------------------------------------------------------------------


def offer(
    messages: list[dict[str, Any]], request: ToolRequest | None, fmt: ToolFormat
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the template's ``tools`` variable: the tools for a template that takes
    them, else None and the generic block in the system turn (one is added when none leads)."""
    if request is None or not request.active:
        return messages, None
    if fmt.in_template:
        return messages, [_template_tool(t) for t in request.tools]
    block = fmt.syntax.system_block(request.tools)
    if messages and messages[0]["role"] in ("system", "developer"):
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{block}" if first["content"] else block
        return [first, *messages[1:]], None
    return [{"role": "system", "content": block}, *messages], None


def _template_tool(tool: ToolSpec) -> dict[str, Any]:
    """A tool as chat templates read it (OpenAI's shape, as Hugging Face passes it)."""
    fn = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    return {"type": "function", "function": fn}


def history_turn(
    index: int,
    role: str,
    content: str,
    tool_calls: Any,
    tool_call_id: Any,
    known: dict[str, str],
    fmt: ToolFormat,
) -> dict[str, Any]:
    """A tool-related turn of the history as the template renders it; ``known`` maps the ids
    of assistant calls so far to their names: every tool result must answer one."""
    if role == "assistant" and tool_calls:
        calls = [_history_call(index, j, c, known) for j, c in enumerate(tool_calls)]
        return assistant_calls(content, calls, fmt)
    if role == "tool":
        param = f"messages.{index}.tool_call_id"
        if not isinstance(tool_call_id, str):
            raise bad_request(f"{param} is required for a tool message", param)
        if tool_call_id not in known:
            raise bad_request(
                f"{param}: no assistant tool call with id {tool_call_id!r} comes before it", param
            )
        return tool_result(tool_call_id, known[tool_call_id], content, fmt)
    return {"role": role, "content": content}


def assistant_calls(
    content: str, calls: list[tuple[str, str, str]], fmt: ToolFormat
) -> dict[str, Any]:
    """An assistant turn with calls (id, name, arguments JSON): ``tool_calls`` for a template
    that renders them, else the calls written in the model's syntax after the content."""
    if fmt.in_template:
        tool_calls = [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments_value(arguments)},
            }
            for call_id, name, arguments in calls
        ]
        return {"role": "assistant", "content": content, "tool_calls": tool_calls}
    text = fmt.syntax.calls_text([(name, arguments) for _, name, arguments in calls])
    return {"role": "assistant", "content": f"{content}\n{text}" if content else text}


def tool_result(call_id: str, name: str, content: str, fmt: ToolFormat) -> dict[str, Any]:
    """A tool's result: a ``tool`` turn for a template that renders them, else a user turn."""
    if fmt.in_template:
        return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}
    return {"role": "user", "content": result_text(content)}


def result_text(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


def _history_call(index: int, j: int, call: Any, known: dict[str, str]) -> tuple[str, str, str]:
    param = f"messages.{index}.tool_calls.{j}"
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"{param}.function.name is required", f"{param}.function")
    arguments = fn.get("arguments", "")
    if not isinstance(arguments, str):
        raise bad_request(f"{param}.function.arguments must be a string", param)
    call_id = call.get("id")
    if not isinstance(call_id, str):
        call_id = f"call_{index}_{j}"
    known[call_id] = fn["name"]
    return call_id, fn["name"], arguments


# -- the response ----------------------------------------------------------------------------


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def message(text: str, reader: CallReader) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole reply split into its content (None when it only calls) and its tool calls; a
    call cut short (max_tokens) is dropped."""
    content, _ = reader.feed(text)
    content += reader.finish()
    calls = [
        {"id": new_call_id(), "type": "function", "function": {"name": n, "arguments": a}}
        for n, a in list(zip(reader.names, reader.arguments, strict=False))[: reader.closed]
    ]
    if not calls:
        return content, []
    return content.strip() or None, calls


@dataclass(slots=True)
class StreamedCalls:
    """One choice's stream: content deltas and tool-call deltas as OpenAI sends them (the id,
    type and name once, then the arguments in pieces)."""

    reader: CallReader
    ids: list[str] = field(default_factory=list)  # the calls' ids, by their index in the stream
    at: dict[int, int] = field(default_factory=dict)  # a reader's call -> its stream index

    def deltas(self, text: str) -> Iterator[dict[str, Any]]:
        content, pieces = self.reader.feed(text)
        if content:
            yield {"content": content}
        for piece in pieces:
            yield self._call_delta(piece)

    def finish(self) -> Iterator[dict[str, Any]]:
        rest = self.reader.finish()
        if rest:
            yield {"content": rest}

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def _call_delta(self, piece: CallPiece) -> dict[str, Any]:
        if piece.name is not None:  # a new call always takes the next index, never an old one
            self.at[piece.index] = len(self.ids)
            self.ids.append(new_call_id())
        index = self.at[piece.index]
        entry: dict[str, Any] = {"index": index}
        if piece.name is not None:
            entry |= {
                "id": self.ids[index],
                "type": "function",
                "function": {"name": piece.name, "arguments": piece.arguments},
            }
        else:
            entry["function"] = {"arguments": piece.arguments}
        return {"tool_calls": [entry]}
