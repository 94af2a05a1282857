"""Anthropic's Messages API: POST /v1/messages (JSON or SSE) and /v1/messages/count_tokens.

Every error on these routes answers in Anthropic's envelope,
``{"type": "error", "error": {"type", "message"}}``. A streamed message sends the named events in
the order the SDK requires: message_start, content_block_start, ping, content_block_delta...,
content_block_stop, message_delta, message_stop. A final assistant message is a prefill: the
reply continues it.

Image and document blocks go through the media policy (media.py) like chat's media parts, so a
refused URL or an oversized payload gets its reason, and an accepted one the model's modality
answer. Generation goes through the request timer (metrics.py): TTFT, token counts for the
access log, and the request timeout, which aborts the generation.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from inferd.server import sse
from inferd.server.agent_loop import Started, start_reply
from inferd.server.agent_runtime import progress_asked
from inferd.server.anthropic_images import ImageSlots
from inferd.server.anthropic_output import output_format
from inferd.server.anthropic_protocol import CountTokensRequest, MessagesRequest, _Prompted
from inferd.server.anthropic_tools import (
    StreamedBlocks,
    parse_anthropic_tools,
    reply_blocks,
    turns,
)
from inferd.server.api_limits import check_sampling_limits
from inferd.server.envelope import error_body, error_response
from inferd.server.errors import APIError, bad_request
from inferd.server.events import End, Failure, KeepAlive, events
from inferd.server.generation import SSE_HEADERS, collect
from inferd.server.media import check_media_parts, media_policy
from inferd.server.openai_tools import ToolRequest, offer
from inferd.server.pipeline import ChatJob, prepare, render
from inferd.server.protocol import parse_body, whole_number
from inferd.server.reasoning import ReasoningSplit, ReasoningSplitter
from inferd.server.state import ServerState
from inferd.server.thinking_signature import sign, verify
from inferd.serving.interface import RequestOutput, SamplingParamError, SamplingParams
from inferd.serving.served import ServedModel
from inferd.structured.tool_syntax import CallReader

# thinking.type values; enabled and adaptive both show a reasoning model's thinking. Under
# enabled, budget_tokens bounds it: past that many reasoning tokens the engine closes the think
# block itself and the model goes on to its answer (engine/thinking.py), within max_tokens.
_THINKING_TYPES = ("enabled", "adaptive", "disabled")

_NON_TEXT_BLOCKS = (
    "image",
    "document",
    "server_tool_use",
    "web_search_tool_result",
    "thinking",  # in a user turn; an assistant turn's is verified (_block_reader)
    "redacted_thinking",
    "search_result",
    "container_upload",
)


async def create_message(request: Request) -> Response:
    try:
        return await _create_message(request)
    except APIError as err:
        return _error(request, err)


async def count_tokens(request: Request) -> Response:
    try:
        state: ServerState = request.app.state.inferd
        body = parse_body(await request.body(), CountTokensRequest)
        model = state.resolve_model(body.model)
        # the server's tools are in the prompt as /v1/messages renders its first round
        server = await state.agent.server_tools(
            body.max_tool_rounds, code_execution=body.enable_code_execution
        )
        specs = server.specs if server is not None else ()
        tools = parse_anthropic_tools(body.tools, body.tool_choice, specs)
        output_format(body.output_config, body.output_format)  # checked, though not counted
        # images are decoded and tiled: their placeholder tokens count like the text's; bounded
        # as /v1/messages is: a prompt that cannot fit is refused before tokenizing
        check_media_parts(body.messages, media_policy(request), model)
        prompt, _ = await render(request, model, _job(model, body, tools))
        return JSONResponse({"input_tokens": len(prompt)})
    except APIError as err:
        return _error(request, err)


def _error(request: Request, err: APIError) -> Response:
    return error_response(request.scope, err.status, err.message, headers=err.headers)


async def _create_message(request: Request) -> Response:
    state: ServerState = request.app.state.inferd
    body = parse_body(await request.body(), MessagesRequest)
    model = state.resolve_model(body.model)
    # The cheap checks (tools, sampling, the output format, the conversation), then the
    # pipeline's steps: media, prompt, constraint, admission.
    check_media_parts(body.messages, media_policy(request), model)  # nothing read yet
    progress = progress_asked(body.agent_progress, body.stream)
    server = None
    if body.max_tokens > 0:  # max_tokens 0 only counts the prompt: no round runs
        server = await state.agent.server_tools(
            body.max_tool_rounds, code_execution=body.enable_code_execution
        )
    tools = parse_anthropic_tools(body.tools, body.tool_choice, server.specs if server else ())
    params = _sampling_params(body, model)
    # checked on a worker thread, as chat's response_format is (server/constraints.py)
    fmt = await asyncio.to_thread(output_format, body.output_config, body.output_format)
    # With tools in use the format is the shape of a text answer beside the calls (as chat's
    # response_format beside tools); alone, it holds the whole reply.
    answer = fmt[1] if fmt else None
    loop = server.loop(model, tools, answer) if server is not None else None
    tool_constraint = tools.constraint(model.tool_format, answer) if tools is not None else None
    field: str | None = "tools"
    constraint = tool_constraint
    if tool_constraint is None:
        constraint, field = (fmt[0], fmt[2]) if fmt else (None, None)
    job = replace(
        _job(model, body, tools),
        params=params,
        max_tokens=body.max_tokens,
        constraint=constraint,
        constraint_param=field,
        reasoning=body.thinking is not None and body.thinking.get("type") != "disabled",
        thinking_budget=_budget(body),
    )
    message: dict[str, Any] = {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": model.id,
        "stop_details": None,
        "container": None,
    }
    if body.max_tokens == 0:
        ready = await prepare(request, model, job)
        return _empty_message(message, ready.prompt_tokens, body.stream)
    offered = tools if tool_constraint is not None else None  # whose calls the reply may hold

    def stream_of(started: Started) -> AsyncIterator[bytes]:
        reply_tools = started.final_tools if started.narrowed else offered
        return _stream(
            request,
            message,
            started.streams[0],
            started.ready.prompt_tokens,
            state.keepalive_seconds,
            calls=reply_tools.reader(model.tool_format) if reply_tools is not None else None,
            thinking=started.ready.thinking,
        )

    started = await start_reply(
        request,
        model,
        job,
        loop,
        body.stream,
        stream_of,
        partial(_failure_events, request),
        progress,
    )
    if isinstance(started, Response):
        return started
    ready, streams = started.ready, started.streams
    tools = started.final_tools if started.narrowed else offered
    thinking = ready.thinking
    gens = await collect(request, streams)
    if gens is None:
        return Response(status_code=499)
    (gen,) = gens
    reason, sequence = _stop(gen.final)
    text, thought = gen.text, []
    if thinking is not None:
        reasoning, text = thinking.split(text)
        thought = [_thinking_block(reasoning, model.id)] if reasoning else []
    content = [_text_block(text)]
    if tools is not None:
        content, called = reply_blocks(text, tools.reader(model.tool_format))
        content = [b | {"citations": None} if b["type"] == "text" else b for b in content]
        reason = "tool_use" if called and reason == "end_turn" else reason
    message |= {
        "content": thought + content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _usage(ready.prompt_tokens, gen.final.num_output_tokens),
    }
    return JSONResponse(message)


def _failure_events(request: Request, failure: Failure) -> list[bytes]:
    """The event that ends a stream which failed after it started."""
    err = failure.error
    return [sse.named_event("error", error_body(request.scope, err.status, err.message))]


def _usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    """Anthropic's usage object; what this server has no counterpart for is null."""
    usage: dict[str, Any] = dict.fromkeys(_USAGE_NULLS)
    return usage | {"input_tokens": input_tokens, "output_tokens": output_tokens}


def _message_delta(
    reason: str, sequence: str | None, input_tokens: int, output_tokens: int
) -> bytes:
    """The stream's ``message_delta``: how the message stopped (no container, no stop details
    here, as in the message), and the usage so far, cumulative as Anthropic's is."""
    delta = {"stop_reason": reason, "stop_sequence": sequence, "stop_details": None}
    usage = dict.fromkeys(_DELTA_USAGE_NULLS)
    usage |= {"input_tokens": input_tokens, "output_tokens": output_tokens}
    return _event("message_delta", {"delta": delta | {"container": None}, "usage": usage})


def _text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text, "citations": None}


def _thinking_block(text: str, model_id: str) -> dict[str, Any]:
    """Signed (server/thinking_signature.py): sent back in a later turn, it is verified."""
    return {"type": "thinking", "thinking": text, "signature": sign(model_id, text)}


def _budget(body: _Prompted) -> int | None:
    """``thinking.budget_tokens`` (enabled only), checked; None: no budget."""
    if body.thinking is None or body.thinking.get("type") != "enabled":
        return None
    budget = whole_number(body.thinking.get("budget_tokens"))  # 1024.0 is 1024
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise bad_request(
            "thinking.budget_tokens: must be a positive integer", "thinking.budget_tokens"
        )
    return budget


def _empty_message(message: dict[str, Any], num_prompt_tokens: int, stream: bool) -> Response:
    """max_tokens 0 (a cache warm-up for Anthropic): nothing is generated."""
    usage = _usage(num_prompt_tokens, 0)
    message = message | {"content": [], "stop_reason": None, "stop_sequence": None}
    if not stream:
        message |= {"stop_reason": "max_tokens", "usage": usage}
        return JSONResponse(message)
    frames = [
        _event("message_start", {"message": message | {"usage": usage}}),
        _event("ping", {}),
        _message_delta("max_tokens", None, num_prompt_tokens, 0),
        _event("message_stop", {}),
    ]
    return Response(b"".join(frames), media_type="text/event-stream", headers=SSE_HEADERS)


def _reject_unsupported(body: _Prompted) -> None:
    if body.thinking is not None and body.thinking.get("type") not in _THINKING_TYPES:
        kinds = ", ".join(_THINKING_TYPES)
        raise bad_request(f"thinking.type: must be one of {kinds}", "thinking.type")
    if body.mcp_servers:
        raise bad_request("mcp_servers: MCP is not supported by this server", "mcp_servers")


def _job(model: ServedModel, body: _Prompted, tools: ToolRequest | None) -> ChatJob:
    """The conversation as a job with default sampling (the caller replaces it): its turns
    ending in the assistant's (or its prefill), each image block an image part of the template
    (placed where the rendering puts it)."""
    _reject_unsupported(body)
    messages: list[dict[str, Any]] = []
    known: dict[str, str] = {}  # tool_use ids so far, to their names
    fmt = model.tool_format
    if body.system is not None:
        system_turns = turns("system", body.system, "system", {}, fmt, _text)
        system = "".join(str(m["content"]) for m in system_turns)
        if system:
            messages.append({"role": "system", "content": system})
    slots = ImageSlots()
    for i, m in enumerate(body.messages):
        where = f"messages.{i}.content"
        if m.role != "user" and _holds_image(m.content):
            raise bad_request(f"{where}: images are accepted in user messages only", where)
        messages += turns(
            m.role, m.content, where, known, fmt, _block_reader(m.role, model), slots.part
        )
    messages, template_tools = offer(messages, tools, fmt)
    prefill = messages.pop()["content"] if body.messages[-1].role == "assistant" else ""
    return ChatJob(
        messages,
        body.messages,
        SamplingParams(),
        None,
        tools=template_tools,
        variables=_thinking_variables(body),
        prefill=prefill,
        in_prompt_order=partial(slots.in_rendered_order, messages),
    )


def _thinking_variables(body: _Prompted) -> dict[str, object]:
    """A template that takes ``enable_thinking`` (Qwen3) hears whether thinking was asked
    for; a request that does not say leaves the template's default."""
    if body.thinking is None:
        return {}
    return {"enable_thinking": body.thinking.get("type") != "disabled"}


def _holds_image(content: str | list[dict[str, Any]]) -> bool:
    """Whether a message has an image block, in a tool result's content too."""
    if isinstance(content, str):
        return False
    return any(
        b.get("type") == "image"
        or (b.get("type") == "tool_result" and _holds_image(b.get("content") or ""))
        for b in content
        if isinstance(b, dict)
    )


def _block_reader(role: str, model: ServedModel) -> Callable[[dict[str, Any], str], str]:
    """``_text``, and in an assistant turn its thinking blocks: each must carry this server's
    signature of its text (a 400 otherwise), and is left out of the prompt (templates of
    reasoning models drop earlier turns' thinking)."""

    def read(block: dict[str, Any], where: str) -> str:
        if block.get("type") != "thinking" or role != "assistant":
            return _text(block, where)
        thinking = block.get("thinking")
        if not isinstance(thinking, str):
            raise bad_request(f"{where}.thinking: must be a string", f"{where}.thinking")
        if not verify(model.id, thinking, block.get("signature")):
            raise bad_request(
                f"{where}.signature: not this server's signature of this thinking block",
                f"{where}.signature",
            )
        return ""

    return read


def _text(block: dict[str, Any], where: str) -> str:
    """A content block other than tool_use / tool_result (anthropic_tools.turns reads those):
    its text, or a 400."""
    kind = block.get("type")
    if kind == "text":
        text = block.get("text")
        if not isinstance(text, str):
            raise bad_request(f"{where}.text: must be a string", f"{where}.text")
        return text
    if kind in _NON_TEXT_BLOCKS:
        raise bad_request(
            f"{where}: this server takes text blocks only and cannot accept {kind} blocks", where
        )
    raise bad_request(f"{where}: unknown content block type {kind!r}", f"{where}.type")


# Usage fields of Anthropic's API that this server has nothing to report for (no prompt-cache
# writes or reads billed apart, no server tools, no tiers or regions): present, and null.
_USAGE_NULLS = (
    "cache_creation",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
    "inference_geo",
    "output_tokens_details",
    "server_tool_use",
    "service_tier",
)
# The same, in the usage of a stream's message_delta (which has fewer fields).
_DELTA_USAGE_NULLS = (
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
    "output_tokens_details",
    "server_tool_use",
)
_PARAM_NAMES = {"stop": "stop_sequences"}


def _sampling_params(body: MessagesRequest, model: ServedModel) -> SamplingParams:
    if body.max_tokens < 0:
        raise bad_request(f"max_tokens: must be at least 0, got {body.max_tokens}", "max_tokens")
    if body.temperature is not None and not 0.0 <= body.temperature <= 1.0:
        raise bad_request(
            f"temperature: must be between 0 and 1, got {body.temperature}", "temperature"
        )
    stop = tuple(body.stop_sequences or ())
    try:
        check_sampling_limits(stop)
        return SamplingParams(
            max_tokens=max(1, body.max_tokens),  # 0: validated and answered without generating
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            seed=model.engine_config.seed,
            stop=stop,
        )
    except SamplingParamError as exc:
        param = _PARAM_NAMES.get(exc.param, exc.param)
        raise bad_request(f"{param}: {str(exc).removeprefix(exc.param).strip()}", param) from None


def _stop(out: RequestOutput) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a finished output."""
    if out.finish_reason == "length":
        return "max_tokens", None
    if isinstance(out.stop_reason, str):
        return "stop_sequence", out.stop_reason
    return "end_turn", None


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return sse.named_event(name, {"type": name, **payload})


async def _stream(
    request: Request,
    message: dict[str, Any],
    outputs: AsyncIterator[RequestOutput],
    num_prompt_tokens: int,
    keepalive: float,
    *,
    calls: CallReader | None = None,
    thinking: ReasoningSplit | None = None,
) -> AsyncIterator[bytes]:
    start_message = message | {
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": _usage(num_prompt_tokens, 0),
    }
    yield _event("message_start", {"message": start_message})
    blocks = StreamedBlocks(_event, calls) if calls is not None else None
    thought = _StreamedThinking(thinking.splitter(), message["model"]) if thinking else None
    text_index: int | None = None  # the plain text block, once opened

    def text_delta(text: str, force: bool = False) -> Iterator[bytes]:
        """The answer's text (or blocks, with tools), after any thinking block is closed;
        ``force`` opens the text block even for no text."""
        nonlocal text_index
        first = 0
        if thought is not None:
            if not text and not force:
                return
            first = yield from thought.close()
        if blocks is not None:
            blocks.index = max(blocks.index, first - 1)
            yield from blocks.feed(text)
            return
        if text_index is None:
            text_index = first
            text_block = _text_block("")
            yield _event("content_block_start", {"index": text_index, "content_block": text_block})
        if text:
            delta = {"type": "text_delta", "text": text}
            yield _event("content_block_delta", {"index": text_index, "delta": delta})

    if thought is None:
        for frame in text_delta(""):  # the text block opens at once, as before
            yield frame
    yield _event("ping", {})
    last: RequestOutput | None = None
    async for event in events([outputs], keepalive):
        if isinstance(event, KeepAlive):
            yield _event("ping", {})
        elif isinstance(event, Failure):
            for frame in _failure_events(request, event):
                yield frame
            return
        elif isinstance(event, End):
            (last,) = event.finals
        else:
            text = event.output.text
            if thought is not None:
                frames, text = thought.feed(text, event.output.finished)
                for frame in frames:
                    yield frame
            for frame in text_delta(text):
                yield frame
    assert last is not None
    reason, sequence = _stop(last)
    if blocks is None:
        if text_index is None:  # all thinking: an empty text block still ends the reply
            for frame in text_delta("", force=True):
                yield frame
        yield _event("content_block_stop", {"index": text_index})
    else:
        for frame in text_delta("", force=True):  # closes a thinking block nothing followed
            yield frame
        for frame in blocks.finish():
            yield frame
        reason = "tool_use" if blocks.calls and reason == "end_turn" else reason
    yield _message_delta(reason, sequence, num_prompt_tokens, last.num_output_tokens)
    yield _event("message_stop", {})


@dataclass(slots=True)
class _StreamedThinking:
    """A reasoning model's thinking as a ``thinking`` block at index 0 (thinking_delta events),
    closed when the answer starts."""

    splitter: ReasoningSplitter
    model_id: str  # signs the block's whole text
    opened: bool = False
    closed: bool = False
    text: str = ""

    def feed(self, text: str, finished: bool) -> tuple[list[bytes], str]:
        """The thinking events for this piece, and the answer's text in it."""
        reasoning, content = self.splitter.feed(text)
        if finished:
            more_reasoning, more_content = self.splitter.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        events: list[bytes] = []
        if reasoning and not self.closed:
            if not self.opened:
                self.opened = True
                block = {"type": "thinking", "thinking": "", "signature": ""}
                events.append(_event("content_block_start", {"index": 0, "content_block": block}))
            self.text += reasoning
            delta = {"type": "thinking_delta", "thinking": reasoning}
            events.append(_event("content_block_delta", {"index": 0, "delta": delta}))
        return events, content

    def close(self) -> Generator[bytes, None, int]:
        """Close the thinking block if open; returns the index the next block takes."""
        if self.opened and not self.closed:
            delta = {"type": "signature_delta", "signature": sign(self.model_id, self.text)}
            yield _event("content_block_delta", {"index": 0, "delta": delta})
            yield _event("content_block_stop", {"index": 0})
        self.closed = True
        return 1 if self.opened else 0
