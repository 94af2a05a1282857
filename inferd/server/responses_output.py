"""A response's output items, built from the model's text as it streams, with the typed events
that announce them.

One builder serves both ways of answering: a stream sends the events as they come, a plain
response feeds the whole text at once and keeps only the items, so the two cannot disagree.
With tools, the text goes through the model's call reader (structured/tool_syntax) as chat's does:
prose becomes a ``message`` item (an ``output_text`` part), each call a
``function_call`` item whose arguments stream as ``response.function_call_arguments.delta``.
Whitespace between calls opens no message. A reasoning model's thinking (server/reasoning.py)
comes first, as a ``reasoning`` item whose ``reasoning_text`` part streams as
``response.reasoning_text.delta``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from inferd.agent.tools import ToolResult
from inferd.server.agent_loop import call_tool
from inferd.server.agent_runtime import HostedSource, RanCall, ToolLoop
from inferd.server.approvals import CallOrigin
from inferd.server.errors import bad_request
from inferd.server.openai_tools import new_call_id
from inferd.server.reasoning import ReasoningSplitter
from inferd.server.responses_input import new_id
from inferd.structured.tool_syntax.base import CallReader

Event = dict[str, Any]


@dataclass(slots=True)
class OutputBuilder:
    reader: CallReader | None  # None: the reply holds no tool calls (none offered, or none)
    items: list[dict[str, Any]] = field(default_factory=list)
    open: dict[str, Any] | None = None
    blank: str = ""  # whitespace waiting for prose to follow it
    thinking: ReasoningSplitter | None = None  # splits a reasoning model's thinking off first
    # a message's text -> its annotations (url_citation, with web search), set as it closes
    cite: Callable[[str], list[dict[str, Any]]] | None = None

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self.thinking is not None:
            reasoning, text = self.thinking.feed(text)
            events += self._reasoning(reasoning)
        return events + self._content(text)

    def _content(self, text: str) -> list[Event]:
        if self.reader is None:
            return self._text(text)
        content, pieces = self.reader.feed(text)
        events = self._text(content)
        for piece in pieces:
            if piece.name is not None:
                events += self._close("completed")
                events += self._open_call(piece.name)
            if piece.arguments:
                assert self.open is not None
                self.open["arguments"] += piece.arguments
                events.append(
                    {
                        "type": "response.function_call_arguments.delta",
                        "item_id": self.open["id"],
                        "output_index": len(self.items) - 1,
                        "delta": piece.arguments,
                    }
                )
        return events

    def finish(self, complete: bool) -> list[Event]:
        """Close the last item (``complete``: the model ended its turn, else it was cut)."""
        events: list[Event] = []
        if self.thinking is not None:
            reasoning, text = self.thinking.finish()
            events += self._reasoning(reasoning) + self._content(text)
        events += self._text(self.reader.finish()) if self.reader is not None else []
        if all(item["type"] == "reasoning" for item in self.items):
            events += self._close("completed" if complete else "incomplete")
            events += self._open_message()  # an empty answer is still a message, empty text
        return events + self._close("completed" if complete else "incomplete")

    @property
    def called(self) -> bool:
        return any(item["type"] == "function_call" for item in self.items)

    # -- items -------------------------------------------------------------------------------

    def _reasoning(self, text: str) -> list[Event]:
        """A ``reasoning`` item (its text as one ``reasoning_text`` part), opened on the first
        piece; it comes before any other item, since thinking precedes the answer."""
        if not text:
            return []
        events: list[Event] = []
        if self.open is None:
            item: dict[str, Any] = {
                "id": new_id("rs"),
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}],
                "status": "in_progress",
            }
            self.items.append(item)
            self.open = item
            added = {"type": "response.output_item.added", "output_index": len(self.items) - 1}
            events.append(added | {"item": _copy(item)})
        assert self.open is not None and self.open["type"] == "reasoning"
        self.open["content"][0]["text"] += text
        events.append(self._part_event("response.reasoning_text.delta") | {"delta": text})
        return events

    def _text(self, text: str) -> list[Event]:
        if not text:
            return []
        events: list[Event] = []
        if self.open is None or self.open["type"] != "message":
            if self.reader is not None and not text.strip():
                self.blank += text
                return []
            events += self._close("completed")
            events += self._open_message()
            text, self.blank = self.blank + text, ""
        assert self.open is not None
        part = self.open["content"][0]
        part["text"] += text
        events.append(
            self._part_event("response.output_text.delta") | {"delta": text, "logprobs": []}
        )
        return events

    def _open_message(self) -> list[Event]:
        item: dict[str, Any] = {
            "id": new_id("msg"),
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        self.items.append(item)
        self.open = item
        added = {"type": "response.output_item.added", "output_index": len(self.items) - 1}
        events = [added | {"item": _copy(item)}]
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        events.append(self._part_event("response.content_part.added") | {"part": dict(part)})
        return events

    def _open_call(self, name: str) -> list[Event]:
        item = {
            "id": new_id("fc"),
            "type": "function_call",
            "call_id": new_call_id(),
            "name": name,
            "arguments": "",
            "status": "in_progress",
        }
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        return [{"type": "response.output_item.added", "output_index": index, "item": _copy(item)}]

    def _close(self, status: str) -> list[Event]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        events: list[Event] = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events.append(
                self._part_event("response.reasoning_text.done", item, index) | {"text": text}
            )
        elif item["type"] == "message":
            part = item["content"][0]
            part["annotations"] = self.cite(part["text"]) if self.cite is not None else []
            for number, annotation in enumerate(part["annotations"]):
                events.append(
                    self._part_event("response.output_text.annotation.added", item, index)
                    | {"annotation_index": number, "annotation": annotation}
                )
            events.append(
                self._part_event("response.output_text.done", item, index)
                | {"text": part["text"], "logprobs": []}
            )
            events.append(
                self._part_event("response.content_part.done", item, index) | {"part": dict(part)}
            )
        else:
            events.append(
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
        item["status"] = status
        events.append(
            {"type": "response.output_item.done", "output_index": index} | {"item": _copy(item)}
        )
        return events

    def _part_event(
        self, kind: str, item: dict[str, Any] | None = None, index: int | None = None
    ) -> Event:
        item = item if item is not None else self.open
        assert item is not None
        return {
            "type": kind,
            "item_id": item["id"],
            "output_index": index if index is not None else len(self.items) - 1,
            "content_index": 0,
        }


def mcp_call_item(call: RanCall) -> dict[str, Any]:
    """A call the agent loop ran, as OpenAI's ``mcp_call`` item (``server_label``: its tool
    source, the MCP server's name in the config)."""
    failed = call.result.is_error
    return {
        "id": new_id("mcp"),
        "type": "mcp_call",
        "server_label": call.source,
        "name": call.name,
        "arguments": call.arguments,
        # A tool's failure is a result the model read: its text is the output, and the status
        # says it failed. (``error`` is left null: it is a string in the pinned OpenAPI
        # document and an object in the current SDK, and a tool's text is neither's.)
        "output": call.result.content,
        "error": None,
        "status": "failed" if failed else "completed",
        "approval_request_id": None,
    }


def mcp_approval_request_item(call: RanCall) -> dict[str, Any]:
    """A call waiting for approval, as OpenAI's ``mcp_approval_request`` item: a next request
    answers it with an ``mcp_approval_response`` input item naming its id."""
    return {
        "id": new_id("mcpr"),
        "type": "mcp_approval_request",
        "server_label": call.source,
        "name": call.name,
        "arguments": call.arguments,
    }


async def answered_calls(
    loop: ToolLoop | None,
    history: list[dict[str, Any]],
    items: list[dict[str, Any]],
    origin: CallOrigin,
) -> list[dict[str, Any]]:
    """The ``mcp_call`` items of the approvals ``items`` answer: the approved calls run now,
    side by side, a denied one is a result saying so. An answer already acted on (a client
    sending the whole conversation again) is not run twice; one naming no request, or a tool
    this request does not offer, is a 400."""
    earlier = history + items
    asked = {i["id"]: i for i in earlier if i["type"] == "mcp_approval_request"}
    done = {i.get("approval_request_id") for i in earlier if i["type"] == "mcp_call"}
    answers: list[tuple[dict[str, Any], bool]] = []  # the request each answers, approved
    for index, answer in enumerate(items):
        if answer["type"] != "mcp_approval_response" or answer["approval_request_id"] in done:
            continue
        where = f"input.{index}.approval_request_id"
        asking = asked.get(answer["approval_request_id"])
        if asking is None:
            raise bad_request(f"{where}: no mcp_approval_request with this id comes before", where)
        name = asking["name"]
        if loop is None or name not in loop.allowed or not loop.runs(name):
            raise bad_request(
                f"{where}: the tool {name!r} is not offered in this request; send its mcp tool "
                "again",
                where,
            )
        answers.append((asking, answer["approve"]))
    if not answers:
        return []
    assert loop is not None

    async def outcome(asking: dict[str, Any], approve: bool) -> ToolResult:
        if not approve:
            return ToolResult("the user did not approve this call", is_error=True)
        name, arguments = asking["name"], asking["arguments"]
        return await call_tool(loop, name, arguments, origin, approved=True)

    results = await asyncio.gather(*(outcome(a, approve) for a, approve in answers))
    return [
        mcp_call_item(RanCall(a["id"], a["name"], a["arguments"], result, a["server_label"]))
        | {"approval_request_id": a["id"]}
        for (a, _), result in zip(answers, results, strict=True)
    ]


def mcp_list_tools_item(hosted: HostedSource) -> dict[str, Any]:
    """A request's MCP server's tools, as OpenAI's ``mcp_list_tools`` item."""
    tools = [
        {
            "name": t.remote_name,
            "description": t.description,
            "input_schema": dict(t.input_schema),
            "annotations": None,
        }
        for t in hosted.listed()
    ]
    label = hosted.source.name
    return {"id": new_id("mcpl"), "type": "mcp_list_tools", "server_label": label} | {
        "tools": tools,
        "error": None,
    }


def ran_events(items: list[dict[str, Any]]) -> list[Event]:
    """The events of items the agent loop finished before the answer (``mcp_list_tools``,
    ``mcp_call``), first in a stream: each item added, in progress, completed (or failed),
    done."""
    events: list[Event] = []
    for index, item in enumerate(items):
        kind = item["type"]
        where = {"output_index": index, "item_id": item["id"]}
        running = dict(item)
        if kind == "mcp_call":
            running |= {"output": None, "error": None, "status": "in_progress"}
        if kind == "web_search_call":
            running |= {"status": "in_progress"}
        ended = "failed" if item.get("status") == "failed" else "completed"
        progress = [  # an approval request has no progress of its own
            {"type": f"response.{kind}.in_progress"} | where,
            {"type": f"response.{kind}.{ended}"} | where,
        ]
        if kind == "web_search_call":  # its events have no failed one: the item's status says
            progress[1:] = [
                {"type": "response.web_search_call.searching"} | where,
                {"type": "response.web_search_call.completed"} | where,
            ]
        events += [
            {"type": "response.output_item.added", "output_index": index, "item": running},
            *(progress if kind != "mcp_approval_request" else []),
            {"type": "response.output_item.done", "output_index": index, "item": dict(item)},
        ]
    return events


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of an item as it is now (events must not change as the item grows)."""
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(p) for p in out["content"]]
    return out


def output_text(items: list[dict[str, Any]]) -> str:
    return "".join(
        p["text"]
        for item in items
        if item["type"] == "message"
        for p in item["content"]
        if p["type"] == "output_text"
    )
