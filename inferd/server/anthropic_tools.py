"""Anthropic tool use on /v1/messages: ``tools`` with ``input_schema``, ``tool_choice`` (auto,
any, tool, none; ``disable_parallel_tool_use``), ``tool_use`` / ``tool_result`` blocks in the
history, and ``tool_use`` blocks in the reply, streamed with ``input_json_delta`` events.

The model side is the same as OpenAI tools (server/openai_tools.py): the model's ToolFormat
(its chat template's tools, or the generic block), constrained calls (``any`` and ``tool``
wholly, ``auto`` from the moment a call opens), read in the model's syntax.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from inferd.server.errors import APIError, bad_request
from inferd.server.openai_tools import (
    ToolRequest,
    assistant_calls,
    parse_tools,
    result_text,
    tool_result,
)
from inferd.structured.tool_syntax import CallReader, ToolFormat, ToolSpec

_CHOICES = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}


def parse_anthropic_tools(
    tools: list[Any] | None, choice: Any, server: Sequence[ToolSpec] = ()
) -> ToolRequest | None:
    """Anthropic's tools and tool_choice as the shared ToolRequest (400s name the field)."""
    as_openai: list[Any] = []
    for i, tool in enumerate(tools or ()):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise bad_request(
                f"tools.{i}: only custom tools (name, input_schema) are supported, not {kind!r}",
                f"tools.{i}",
            )
        if "input_schema" not in tool:
            raise bad_request(f"tools.{i}.input_schema is required", f"tools.{i}.input_schema")
        fn = {
            "name": tool.get("name"),
            "description": tool.get("description") or "",
            "parameters": tool["input_schema"],
        }
        if "strict" in tool:
            fn["strict"] = tool["strict"]
        as_openai.append({"type": "function", "function": fn})
    mode, parallel = _choice(choice)
    try:
        return parse_tools(as_openai, mode, parallel, server)
    except APIError as exc:  # OpenAI's field names, reworded into Anthropic's
        raise bad_request(_anthropic(exc.message), _anthropic(exc.param or "tools")) from None


def _anthropic(text: str) -> str:
    text = text.replace(".function.parameters", ".input_schema")
    return text.replace(".function.name", ".name").replace(".function.strict", ".strict")


def _choice(choice: Any) -> tuple[Any, bool | None]:
    if choice is None:
        return None, None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if not isinstance(kind, str) or kind not in _CHOICES:
        raise bad_request("tool_choice.type must be auto, any, tool or none", "tool_choice.type")
    disable = choice.get("disable_parallel_tool_use")
    parallel = None if disable is None else not bool(disable)
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    return _CHOICES[kind], parallel


# -- the history -----------------------------------------------------------------------------


Part = dict[str, Any]  # a chat content part: {"type": "text", "text": ...} or an image's
# Reads an image block (at its path) into the image part the chat template takes.
ImagePart = Callable[[dict[str, Any], str], Part]


def turns(
    role: str,
    content: str | list[dict[str, Any]],
    where: str,
    known: dict[str, str],
    fmt: ToolFormat,
    block_text: Callable[[dict[str, Any], str], str],
    image_part: ImagePart | None = None,
) -> list[dict[str, Any]]:
    """One Anthropic message as the template's messages: tool_use blocks become the turn's
    calls and tool_result blocks tool results, each the way the model's ToolFormat renders
    them (server/openai_tools.py); ``block_text`` reads any other block. ``known`` maps the
    tool_use ids so far to their names: every tool_result must answer one.

    With ``image_part``, image blocks (in the message, or in a tool_result's content) become
    image parts in their place, and a turn holding one has a list of parts for content (text
    parts between them) instead of a string; without it they go to ``block_text``."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    parts: list[Part] = []  # the turn's own text and images, in order
    calls: list[tuple[str, str, str]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.{j}"
        kind = block.get("type")
        if kind == "tool_use":
            calls.append(_call(block, at, known))
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or call_id not in known:
                raise bad_request(
                    f"{at}.tool_use_id: no tool_use block with id {call_id!r} comes before it",
                    f"{at}.tool_use_id",
                )
            result = _result_parts(block.get("content"), at, image_part)
            if fmt.in_template:
                tool_turn = tool_result(call_id, known[call_id], "", fmt)
                results.append(tool_turn | {"content": _content(result)})
            else:  # in order among the text, as a user turn reads it
                parts += ([_text_part("\n")] if parts else []) + _wrapped(result)
        elif kind == "image" and image_part is not None:
            parts.append(image_part(block, at))
        else:
            parts.append(_text_part(block_text(block, at)))
    turn = _content(parts)
    if calls:
        if not isinstance(turn, str):
            raise bad_request(f"{where}: a message with tool_use blocks takes no images", where)
        return [assistant_calls(turn, calls, fmt)]
    if results:
        return results + ([{"role": role, "content": turn}] if turn else [])
    return [{"role": role, "content": turn}]


def _text_part(text: str) -> Part:
    return {"type": "text", "text": text}


def _content(parts: list[Part]) -> str | list[Part]:
    """A turn's content: its text when it has no image, else its parts with adjacent text
    parts joined and empty ones dropped."""
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    merged: list[Part] = []
    for part in parts:
        if part["type"] == "text" and merged and merged[-1]["type"] == "text":
            merged[-1] = _text_part(merged[-1]["text"] + part["text"])
        elif part["type"] != "text" or part["text"]:
            merged.append(part)
    return merged


def _wrapped(result: list[Part]) -> list[Part]:
    """A tool result as text in a user turn (result_text's wrapping), its images in place."""
    before, after = result_text("\0").split("\0")
    return [_text_part(before), *result, _text_part(after)]


def _call(block: dict[str, Any], where: str, known: dict[str, str]) -> tuple[str, str, str]:
    name, call_id = block.get("name"), block.get("id")
    if not isinstance(name, str) or not isinstance(call_id, str):
        raise bad_request(f"{where}: a tool_use block needs a name and an id", where)
    known[call_id] = name
    return call_id, name, json.dumps(block.get("input", {}), ensure_ascii=False)


def _result_parts(content: Any, where: str, image_part: ImagePart | None) -> list[Part]:
    """A tool_result's content: a string, or text blocks (and image blocks with
    ``image_part``), as parts in order."""
    if content is None or isinstance(content, str):
        return [_text_part(content or "")]
    parts: list[Part] = []
    if isinstance(content, list):
        for k, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                parts.append(_text_part(block["text"]))
            elif kind == "image" and image_part is not None:
                parts.append(image_part(block, f"{where}.content.{k}"))
            else:
                break
        else:
            return parts
    kinds = "text and image blocks" if image_part is not None else "text blocks"
    raise bad_request(f"{where}.content: a tool result takes a string or {kinds}", where)


# -- the reply -------------------------------------------------------------------------------


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def reply_blocks(text: str, reader: CallReader) -> tuple[list[dict[str, Any]], bool]:
    """The reply's content blocks (text, then tool_use) and whether it calls a tool."""
    content, _ = reader.feed(text)
    content += reader.finish()
    calls = list(zip(reader.names, reader.arguments, strict=False))[: reader.closed]
    blocks: list[dict[str, Any]] = []
    if content.strip() or not calls:
        blocks.append({"type": "text", "text": content if not calls else content.strip()})
    for name, arguments in calls:
        blocks.append(
            {
                "type": "tool_use",
                "id": new_tool_use_id(),
                "name": name,
                "input": json.loads(arguments),
                "caller": {"type": "direct"},  # the model called it (no server tool did)
            }
        )
    return blocks, bool(calls)


@dataclass(slots=True)
class StreamedBlocks:
    """A streamed reply's content blocks: a text block while text comes, a tool_use block per
    call (its input as ``input_json_delta`` pieces), each opened and closed in order."""

    event: Callable[[str, dict[str, Any]], bytes]
    reader: CallReader
    index: int = -1
    open_kind: str | None = None
    open_call: int = -1
    calls: int = 0

    def feed(self, text: str) -> Iterator[bytes]:
        content, pieces = self.reader.feed(text)
        if content:
            yield from self._text(content)
        for piece in pieces:
            if piece.name is not None:
                yield from self._close()
                self.index += 1
                self.open_kind, self.open_call = "tool_use", piece.index
                self.calls += 1
                block = {"type": "tool_use", "id": new_tool_use_id(), "name": piece.name}
                yield self.event(
                    "content_block_start",
                    {
                        "index": self.index,
                        "content_block": block | {"input": {}, "caller": {"type": "direct"}},
                    },
                )
            if piece.arguments:
                delta = {"type": "input_json_delta", "partial_json": piece.arguments}
                yield self.event("content_block_delta", {"index": self.index, "delta": delta})

    def finish(self) -> Iterator[bytes]:
        rest = self.reader.finish()
        if rest or self.index < 0:
            yield from self._text(rest)
        yield from self._close()

    def _text(self, text: str) -> Iterator[bytes]:
        if self.open_kind != "text":
            yield from self._close()
            self.index += 1
            self.open_kind = "text"
            yield self.event(
                "content_block_start",
                {
                    "index": self.index,
                    "content_block": {"type": "text", "text": "", "citations": None},
                },
            )
        if text:
            delta = {"type": "text_delta", "text": text}
            yield self.event("content_block_delta", {"index": self.index, "delta": delta})

    def _close(self) -> Iterator[bytes]:
        if self.open_kind is not None:
            yield self.event("content_block_stop", {"index": self.index})
            self.open_kind = None
