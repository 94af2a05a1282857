"""The request of POST /v1/responses, and its input as the chat messages the engine renders.

A Responses request is translated, not served apart: its ``input`` items (plus, with
``previous_response_id``, the stored conversation before it) become chat messages, its function
tools and ``tool_choice`` the same ToolRequest chat uses (server/openai_tools.py), and
``text.format`` chat's ``response_format`` (server/constraints.py). Every input item is kept in
one canonical shape, with an id, because that is what ``input_items`` lists and what a later
turn rebuilds the conversation from.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from inferd.server.errors import APIError, bad_request
from inferd.server.openai_tools import ToolRequest, history_turn, parse_tools
from inferd.server.protocol import SamplingFields, WholeInt, _Lenient
from inferd.server.web_search import WEB_SEARCH_TOOLS
from inferd.structured.tool_syntax import ToolFormat, ToolSpec

MAX_METADATA_PAIRS = 16
_INPUT_ROLES = ("user", "system", "developer", "assistant")
_MEDIA_PARTS = ("input_audio",)
# input_image's detail: accepted and kept; the tiles an image becomes are the model's choice, as
# for chat's image_url.
_DETAILS = ("auto", "low", "high")


class ResponsesRequest(_Lenient):
    model: str | None = None
    input: str | list[Any] | None = None
    instructions: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: WholeInt | None = Field(default=None, ge=1)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    truncation: str | None = None
    user: str | None = None
    safety_identifier: str | None = Field(default=None, max_length=64)  # echoed, not used
    prompt_cache_key: str | None = None  # echoed: prefix caching here needs no key
    stream: bool | None = None
    background: bool | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    # inferd's agent loop (server/agent_loop.py): 0 rounds runs none of the server's tools
    max_tool_rounds: WholeInt | None = None
    enable_code_execution: bool | None = None
    # Known to OpenAI, not served here: a request that uses one gets a 400 naming it.
    conversation: Any = None
    prompt: Any = None


_LABEL = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_request(body: ResponsesRequest) -> None:
    if body.conversation is not None:
        raise bad_request(
            "conversation: the Conversations API is not supported; use previous_response_id",
            "conversation",
        )
    if body.prompt is not None:
        raise bad_request("prompt: stored prompt templates are not supported", "prompt")
    if body.truncation not in (None, "auto", "disabled"):
        raise bad_request("truncation must be auto or disabled", "truncation")
    if body.input is None and body.previous_response_id is None:
        raise bad_request("input is required", "input")
    if body.background and body.store is False:
        raise bad_request("background responses must be stored: drop store: false", "background")
    if body.background and body.stream:
        raise bad_request("background: streaming a background response is not supported", "stream")
    metadata = body.metadata or {}
    if len(metadata) > MAX_METADATA_PAIRS:
        raise bad_request(f"metadata: at most {MAX_METADATA_PAIRS} pairs", "metadata")
    for key, value in metadata.items():
        if len(key) > 64 or len(value) > 512:
            raise bad_request(
                "metadata: keys are at most 64 characters and values at most 512", "metadata"
            )


# -- sampling, format and tools as chat takes them --------------------------------------------


def sampling_fields(body: ResponsesRequest) -> SamplingFields:
    """The chat fields this request amounts to (response_format from ``text.format``)."""
    return SamplingFields(
        model=body.model,
        temperature=body.temperature,
        top_p=body.top_p,
        user=body.user,
        response_format=response_format(body.text),
    )


def text_config(text: dict[str, Any] | None) -> dict[str, Any]:
    """The ``text`` field of the response object."""
    fmt = (text or {}).get("format") or {"type": "text"}
    return {"format": fmt}


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    if text is None:
        return None
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object with a type", "text.format")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise bad_request(
            f"text.format: unknown type {kind!r}; expected text, json_object or json_schema",
            "text.format.type",
        )
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def renamed(err: APIError) -> APIError:
    """A chat error about ``response_format`` reworded for ``text.format``."""
    old, new = "response_format.json_schema", "text.format"
    message = err.message.replace(old, new).replace("response_format", "text.format")
    param = (err.param or "").replace(old, new).replace("response_format", "text.format")
    return APIError(err.status, message, param or None, err.code, err.headers)


@dataclass(frozen=True, slots=True)
class HostedMcp:
    """A request's ``mcp`` tool: a remote MCP server the server connects to for it."""

    index: int  # where it is in ``tools``, for errors
    server_label: str
    server_url: str
    headers: dict[str, str]
    allowed_tools: frozenset[str] | None  # None: all its tools
    never_ask: frozenset[str] | None  # tools that run without approval (None: all of them)


def hosted_mcp(body: ResponsesRequest) -> list[HostedMcp]:
    """The request's ``mcp`` tools, their fields checked (the URL policy comes later)."""
    hosted = [
        _hosted(i, t)
        for i, t in enumerate(body.tools or ())
        if isinstance(t, dict) and t.get("type") == "mcp"
    ]
    labels = [h.server_label for h in hosted]
    if len(set(labels)) != len(labels):
        raise bad_request("tools: two mcp tools have the same server_label", "tools")
    return hosted


def _hosted(index: int, tool: dict[str, Any]) -> HostedMcp:
    where = f"tools.{index}"
    label = tool.get("server_label")
    if not isinstance(label, str) or not _LABEL.fullmatch(label):
        raise bad_request(
            f"{where}.server_label must be 1 to 64 letters, digits, _ or -", f"{where}.server_label"
        )
    if tool.get("connector_id") is not None:
        raise bad_request(f"{where}.connector_id: connectors are not supported", where)
    url = tool.get("server_url")
    if not isinstance(url, str) or not url:
        raise bad_request(f"{where}.server_url is required", f"{where}.server_url")
    headers = tool.get("headers") or {}
    if not isinstance(headers, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
    ):
        raise bad_request(f"{where}.headers must map names to strings", f"{where}.headers")
    allowed = tool.get("allowed_tools")
    if isinstance(allowed, dict):
        allowed = allowed.get("tool_names")
    if allowed is not None and not (
        isinstance(allowed, list) and all(isinstance(n, str) for n in allowed)
    ):
        raise bad_request(
            f"{where}.allowed_tools must be a list of tool names", f"{where}.allowed_tools"
        )
    return HostedMcp(
        index,
        label,
        url,
        headers,
        None if allowed is None else frozenset(allowed),
        _never_ask(tool.get("require_approval"), where),
    )


def _never_ask(value: Any, where: str) -> frozenset[str] | None:
    """``require_approval`` as the tools that need none: ``never`` (None: all), ``always`` or
    absent (OpenAI's default: every call approved), or ``{"never": {"tool_names": [...]}}``."""
    if value == "never":
        return None
    if value is None or value == "always":
        return frozenset()
    names = value.get("never", {}).get("tool_names") if isinstance(value, dict) else None
    if isinstance(value, dict) and set(value) <= {"never", "always"} and isinstance(names, list):
        return frozenset(n for n in names if isinstance(n, str))
    raise bad_request(
        f"{where}.require_approval must be always, never or {{never: {{tool_names: [...]}}}}",
        f"{where}.require_approval",
    )


def tool_request(body: ResponsesRequest, server: Sequence[ToolSpec] = ()) -> ToolRequest | None:
    """Responses' flat function tools as chat's, for the shared ToolRequest; ``server``: the
    tools the server runs (its own and the request's ``mcp`` servers')."""
    as_chat: list[Any] = []
    for i, tool in enumerate(body.tools or ()):
        if isinstance(tool, dict) and tool.get("type") == "mcp":
            continue  # hosted_mcp's; its tools come in ``server``
        if isinstance(tool, dict) and tool.get("type") in WEB_SEARCH_TOOLS:
            continue  # search_tool's; the search tool comes in ``server``
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise bad_request(
                f"tools.{i}: only function, mcp and web_search tools are supported, not {kind!r}",
                f"tools.{i}.type",
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        if fn.get("parameters") is None:
            fn.pop("parameters", None)
        as_chat.append({"type": "function", "function": fn})
    choice = body.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "mcp":  # one tool of an mcp server
        choice = {"type": "function", "name": choice.get("name")}
    if isinstance(choice, dict) and choice.get("type") in WEB_SEARCH_TOOLS:
        choice = "auto"  # the server searches before the model's first round anyway
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise bad_request(
                "tool_choice must be none, auto, required or {type: function, name}",
                "tool_choice",
            )
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    try:
        return parse_tools(as_chat, choice, body.parallel_tool_calls, server)
    except APIError as exc:
        message = exc.message.replace(".function.", ".")
        raise bad_request(message, (exc.param or "tools").replace(".function.", ".")) from None


def echo_tools(tools: list[Any] | None) -> list[dict[str, Any]]:
    """The request's tools as the response object lists them (an mcp tool's headers, which
    may hold credentials, are not repeated)."""
    return [_echo(t) for t in tools or ()]


def _echo(tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") in WEB_SEARCH_TOOLS:
        kept = ("search_context_size", "user_location", "filters", "search_content_types")
        return {"type": tool["type"]} | {k: tool[k] for k in kept if k in tool}
    if tool.get("type") == "mcp":
        return {
            "type": "mcp",
            "server_label": tool["server_label"],
            "server_url": tool.get("server_url"),
            "allowed_tools": tool.get("allowed_tools"),
            "require_approval": tool.get("require_approval", "always"),
            "headers": None,
        }
    return {
        "type": "function",
        "name": tool["name"],
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict", True),
    }


# -- input items ------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_items(value: str | list[Any] | None, known_calls: set[str]) -> list[dict[str, Any]]:
    """The request's input as canonical items with ids; ``known_calls`` holds the call ids of
    the conversation so far (the stored turns before it), and gains this input's."""
    if value is None:
        return []
    if isinstance(value, str):
        return [_message_item("user", [{"type": "input_text", "text": value}])]
    return [_item(i, item, known_calls) for i, item in enumerate(value)]


def _message_item(role: str, content: list[dict[str, Any]], item_id: Any = None) -> dict[str, Any]:
    item_id = item_id if isinstance(item_id, str) and item_id else new_id("msg")
    return {"id": item_id, "type": "message", "role": role, "status": "completed"} | {
        "content": content
    }


def _item(index: int, item: Any, known_calls: set[str]) -> dict[str, Any]:
    where = f"input.{index}"
    if not isinstance(item, dict):
        raise bad_request(f"{where}: an input item is an object", where)
    if item.get("id") is not None and not isinstance(item["id"], str):
        # the id is the stored item's key (and what input_items lists): a string or absent
        raise bad_request(f"{where}.id must be a string", f"{where}.id")
    kind = item.get("type", "message")
    if kind == "message":
        return _message(where, item)
    if kind == "function_call":
        fields = {k: item.get(k) for k in ("call_id", "name", "arguments")}
        for key, value in fields.items():
            if not isinstance(value, str) or (key != "arguments" and not value):
                raise bad_request(f"{where}.{key}: a string is required", f"{where}.{key}")
        known_calls.add(str(fields["call_id"]))
        item_id = item.get("id") if isinstance(item.get("id"), str) else new_id("fc")
        return {"id": item_id, "type": "function_call", "status": "completed"} | fields
    if kind == "function_call_output":
        call_id = item.get("call_id")
        if not isinstance(call_id, str) or call_id not in known_calls:
            raise bad_request(
                f"{where}.call_id: no function_call with call_id {call_id!r} comes before this "
                "function_call_output",
                f"{where}.call_id",
            )
        output = _output_text(where, item.get("output"))
        item_id = item.get("id") if isinstance(item.get("id"), str) else new_id("fco")
        return {
            "id": item_id,
            "type": "function_call_output",
            "call_id": call_id,
            "output": output,
            "status": "completed",
        }
    if kind == "mcp_call":  # a call the server ran, sent back: rendered as a call and result
        return _mcp_call(where, item)
    if kind == "mcp_approval_response":
        return _approval_response(where, item)
    # kept, not rendered (a web search's results are not replayed: the answer quoting them is)
    if kind in ("reasoning", "mcp_list_tools", "mcp_approval_request", "web_search_call"):
        return dict(item) | {"id": item.get("id") or new_id("rs")}
    raise bad_request(
        f"{where}.type: unsupported input item type {kind!r}; expected message, function_call, "
        "function_call_output or mcp_call",
        f"{where}.type",
    )


def _approval_response(where: str, item: dict[str, Any]) -> dict[str, Any]:
    request_id = item.get("approval_request_id")
    if not isinstance(request_id, str) or not request_id:
        raise bad_request(
            f"{where}.approval_request_id: a string is required", f"{where}.approval_request_id"
        )
    if not isinstance(item.get("approve"), bool):
        raise bad_request(f"{where}.approve must be true or false", f"{where}.approve")
    item_id = item.get("id") if isinstance(item.get("id"), str) else new_id("mcpa")
    return {
        "id": item_id,
        "type": "mcp_approval_response",
        "approval_request_id": request_id,
        "approve": item["approve"],
        "reason": item.get("reason") if isinstance(item.get("reason"), str) else None,
    }


def _mcp_call(where: str, item: dict[str, Any]) -> dict[str, Any]:
    fields = {k: item.get(k) for k in ("server_label", "name", "arguments")}
    for key, value in fields.items():
        if not isinstance(value, str) or (key == "name" and not value):
            raise bad_request(f"{where}.{key}: a string is required", f"{where}.{key}")
    result = {k: item.get(k) for k in ("output", "error")}
    for key, value in result.items():
        if value is not None and not isinstance(value, str):
            raise bad_request(f"{where}.{key} must be a string or null", f"{where}.{key}")
    item_id = item.get("id") if isinstance(item.get("id"), str) else new_id("mcp")
    given = item.get("status")
    status = given if given in ("completed", "failed") else "completed"
    if result["error"] is not None:
        status = "failed"
    approval = item.get("approval_request_id")  # the approval it carried out, if any
    extra = {"approval_request_id": approval if isinstance(approval, str) else None}
    return {"id": item_id, "type": "mcp_call"} | fields | result | {"status": status} | extra


def _message(where: str, item: dict[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if role not in _INPUT_ROLES:
        raise bad_request(
            f"{where}.role must be one of {', '.join(_INPUT_ROLES)}, got {role!r}", f"{where}.role"
        )
    content = item.get("content")
    text_kind = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        parts: list[dict[str, Any]] = [{"type": text_kind, "text": content}]
    elif isinstance(content, list):
        parts = [_part(f"{where}.content.{j}", p, role) for j, p in enumerate(content)]
    else:
        raise bad_request(f"{where}.content: a string or a list of parts", f"{where}.content")
    if role == "assistant":
        parts = [
            p | {"annotations": [], "logprobs": []} if p["type"] == "output_text" else p
            for p in parts
        ]
    return _message_item(role, parts, item.get("id"))


def _part(where: str, part: Any, role: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    allowed = ("output_text", "refusal") if role == "assistant" else ("input_text",)
    if kind == "input_image":
        return _image_part(where, part, role)
    if kind == "input_file":
        return _file_part(where, part, role)
    if kind in _MEDIA_PARTS:
        raise bad_request(
            f"{where}: {kind} parts are not supported on /v1/responses yet (text and images)",
            where,
        )
    if kind not in allowed:
        raise bad_request(
            f"{where}.type: a {role} message takes {' or '.join(allowed)} parts, not {kind!r}",
            f"{where}.type",
        )
    key = "refusal" if kind == "refusal" else "text"
    text = part.get(key)
    if not isinstance(text, str):
        raise bad_request(f"{where}.{key} must be a string", f"{where}.{key}")
    return {"type": kind, key: text}


def _image_part(where: str, part: dict[str, Any], role: str) -> dict[str, Any]:
    """An ``input_image`` part, checked for its shape here; its URL is checked, loaded and
    decoded with the media policy as chat's image_url is (see ``media_messages``)."""
    if role != "user":
        raise bad_request(f"{where}: images are accepted in user messages only", where)
    detail = part.get("detail", "auto")
    if detail not in _DETAILS:
        raise bad_request(
            f"{where}.detail must be one of {', '.join(_DETAILS)}, got {detail!r}",
            f"{where}.detail",
        )
    file_id = part.get("file_id")
    if file_id is not None:  # read from /v1/files next (file_inputs.py)
        if not isinstance(file_id, str):
            raise bad_request(f"{where}.file_id must be a string", f"{where}.file_id")
        return {"type": "input_image", "file_id": file_id, "detail": detail}
    url = part.get("image_url")
    if not isinstance(url, str):
        raise bad_request(f"{where}.image_url: a URL string is required", f"{where}.image_url")
    return {"type": "input_image", "image_url": url, "detail": detail}


def _file_part(where: str, part: dict[str, Any], role: str) -> dict[str, Any]:
    """An ``input_file`` part's shape; file_inputs.py reads it into the part its file is."""
    if role != "user":
        raise bad_request(f"{where}: files are accepted in user messages only", where)
    if part.get("file_url") is not None:
        raise bad_request(
            f"{where}.file_url: files are read by file_id or file_data here", f"{where}.file_url"
        )
    keys = ("file_id", "file_data", "filename")
    for key in keys:
        if part.get(key) is not None and not isinstance(part[key], str):
            raise bad_request(f"{where}.{key} must be a string", f"{where}.{key}")
    if part.get("file_id") is None and part.get("file_data") is None:
        raise bad_request(f"{where}: give file_id or file_data", where)
    return {"type": "input_file"} | {k: part[k] for k in keys if part.get(k) is not None}


def media_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The items as messages whose image parts the media policy reads (server/media.py), one
    per item so that a part's path names its item (``messages.3.content.1.image_url``)."""
    return [
        {
            "content": [
                {"type": "image_url", "image_url": p["image_url"]}
                if p["type"] == "input_image"
                else {"type": "text"}
                for p in item["content"]
            ]
            if item["type"] == "message"
            else None
        }
        for item in items
    ]


def _output_text(where: str, output: Any) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(
        isinstance(p, dict) and p.get("type") == "input_text" and isinstance(p.get("text"), str)
        for p in output
    ):
        return "".join(p["text"] for p in output)
    raise bad_request(f"{where}.output: a string or a list of input_text parts", f"{where}.output")


def calls_of(items: list[dict[str, Any]]) -> set[str]:
    return {i["call_id"] for i in items if i.get("type") == "function_call"}


# -- items -> chat messages -------------------------------------------------------------------


def chat_messages(
    instructions: str | None, items: list[dict[str, Any]], fmt: ToolFormat
) -> list[dict[str, Any]]:
    """The conversation as chat messages: an assistant message and the function calls after it
    make one assistant turn, as chat's ``tool_calls`` do (rendered in the model's ``fmt``)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    known: dict[str, str] = {}  # call ids so far, to their names
    turn: dict[str, Any] | None = None  # the assistant turn being gathered

    def flush() -> None:
        nonlocal turn
        if turn is not None:
            messages.append(
                history_turn(
                    len(messages), "assistant", turn["text"], turn["calls"], None, known, fmt
                )
            )
            turn = None

    for item in items:
        kind = item["type"]
        if kind == "message" and item["role"] == "assistant":
            if turn is not None and turn["calls"]:
                flush()
            turn = turn or {"text": "", "calls": []}
            turn["text"] += "".join(p.get("text", p.get("refusal", "")) for p in item["content"])
        elif kind == "function_call":
            turn = turn or {"text": "", "calls": []}
            fn = {"name": item["name"], "arguments": item["arguments"]}
            turn["calls"].append({"id": item["call_id"], "function": fn})
        elif kind == "mcp_call":  # the call and its result, as a function call's would read
            turn = turn or {"text": "", "calls": []}
            fn = {"name": item["name"], "arguments": item["arguments"]}
            turn["calls"].append({"id": item["id"], "function": fn})
            flush()
            result = item["output"] or item["error"] or ""
            if item["status"] == "failed":
                result = f"error: {result}"
            messages.append(
                history_turn(len(messages), "tool", result or "", None, item["id"], known, fmt)
            )
        elif kind == "function_call_output":
            flush()
            messages.append(
                history_turn(
                    len(messages), "tool", item["output"], None, item["call_id"], known, fmt
                )
            )
        elif kind == "message":
            flush()
            messages.append({"role": item["role"], "content": _content(item["content"])})
    flush()
    return messages


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A message's text; with images, its parts as the chat template takes them (the decoded
    images follow the parts' order)."""
    if all(p["type"] != "input_image" for p in parts):
        return "".join(p["text"] for p in parts)
    return [
        {"type": "image"} if p["type"] == "input_image" else {"type": "text", "text": p["text"]}
        for p in parts
    ]


def output_as_input(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored response's output items as the conversation's next items (message and
    function_call items read the same either way)."""
    return [json.loads(json.dumps(item)) for item in output if item["type"] != "reasoning"]
