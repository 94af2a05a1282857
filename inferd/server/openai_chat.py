"""POST /v1/chat/completions: parse -> engine -> JSON or SSE.

``n`` choices are ``n`` independent engine requests sharing the prompt; choice i > 0 samples
with a seed derived from the request's, so every choice differs yet reproduces.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from inferd.server import sse
from inferd.server.agent_loop import Started, start_reply
from inferd.server.agent_runtime import progress_asked
from inferd.server.agent_sessions import keep, open_session
from inferd.server.api_limits import LogprobsAsk, check_n
from inferd.server.auth import request_owner
from inferd.server.constraints import answer_schema, checked_constraint
from inferd.server.errors import bad_request
from inferd.server.events import Failure
from inferd.server.file_inputs import has_file_parts, resolve_chat_files
from inferd.server.generation import (
    Generation,
    clamp,
    collect,
    openai_error,
    sampling_params,
    stream_events,
    token_piece,
    visible_logprobs,
)
from inferd.server.media import check_media_parts, media_policy
from inferd.server.metrics import RequestTimer, request_timer
from inferd.server.openai_tools import StreamedCalls, history_turn, message, offer, parse_tools
from inferd.server.pipeline import ChatJob
from inferd.server.protocol import ChatCompletionRequest, ChatMessage, parse_body
from inferd.server.reasoning import ReasoningSplit, template_variables
from inferd.server.state import ServerState
from inferd.server.web_search import chat_annotations, search_asked
from inferd.serving.interface import RequestOutput, SamplingParams, TokenLogprob
from inferd.serving.served import ServedModel
from inferd.structured.tool_syntax import CallReader, ToolFormat


async def create_chat_completion(request: Request) -> Response:
    state: ServerState = request.app.state.inferd
    body = parse_body(await request.body(), ChatCompletionRequest)
    model = state.resolve_model(body.model)
    _reject_unsupported(body)
    # The cheap checks first: the media parts (counts, URL policy, modality; nothing read
    # yet), fields, n, sampling and logprobs, tools, the output constraint.
    policy = media_policy(request)
    if has_file_parts(body.messages):  # each read from /v1/files or inline, as its kind's part
        await resolve_chat_files(request, body.messages)
    check_media_parts(body.messages, policy, model)
    n = check_n(body.n)
    params = _sampling_params(body, model)
    conversation, session = body.messages, None
    if body.session_id is not None:  # the kept conversation, then the request's messages
        session = await open_session(request, body.session_id, _dumped(body.messages), n)
        stored = [ChatMessage.model_validate(m) for m in session.messages]
        conversation = stored + body.messages
    progress = progress_asked(body.agent_progress, body.stream)
    server = await state.agent.server_tools(
        body.max_tool_rounds,
        n=n,
        code_execution=body.enable_code_execution,
        search=search_asked(body.web_search_options),
        save_files=state.files.sink(request_owner(request)),
    )
    search = server.search if server is not None else None
    tools = parse_tools(
        body.tools, body.tool_choice, body.parallel_tool_calls, server.specs if server else ()
    )
    fmt = model.tool_format
    answer = answer_schema(body)
    loop = server.loop(model, tools, answer) if server is not None else None
    messages, template_tools = offer(_messages(conversation, fmt), tools, fmt)
    tool_constraint = tools.constraint(fmt, answer) if tools is not None else None
    constraint = await checked_constraint(body, tool_constraint)
    # The reply may hold tool calls: a new reader of them per choice.
    calls: Callable[[], CallReader] | None = (
        partial(tools.reader, fmt) if tools is not None and tool_constraint else None
    )
    try:
        variables = template_variables(body.chat_template_kwargs)
    except ValueError as exc:
        raise bad_request(f"chat_template_kwargs: {exc}", "chat_template_kwargs") from None
    ask = None
    if params.logprobs is not None:
        advice = "lower n, top_logprobs or max_completion_tokens"
        ask = LogprobsAsk(n, params.logprobs, "top_logprobs", advice)
    given = body.max_tokens is not None or body.max_completion_tokens is not None
    job = ChatJob(
        messages,
        conversation,
        params,
        params.max_tokens if given else None,
        constraint,
        tools=template_tools,
        variables=variables,
        n=n,
        logprobs=ask,
    )
    completion = _Completion(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model.id)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    new = _dumped(body.messages)

    def kept_by(started: Started) -> Callable[[dict[str, Any]], Awaitable[None]] | None:
        """What keeps the reply's turns in the session once the reply is whole."""
        return partial(keep, request, session, new, started.ran) if session is not None else None

    def stream_of(started: Started) -> AsyncIterator[bytes]:
        ready = started.ready
        return _stream(
            completion,
            model,
            started.streams,
            ready.prompt_tokens,
            include_usage,
            state.keepalive_seconds,
            started.calls(fmt, calls),  # the loop's last round may call fewer tools
            ready.thinking,
            kept_by(started),
            partial(chat_annotations, search) if search is not None else None,
            request_timer(request),
        )

    # the n choices share the prompt
    started = await start_reply(
        request, model, job, loop, body.stream, stream_of, _stream_error, progress
    )
    if isinstance(started, Response):
        return started
    ready = started.ready
    reply = await _collect(
        request,
        completion,
        model,
        started.streams,
        ready.prompt_tokens,
        started.calls(fmt, calls),
        ready.thinking,
    )
    if reply is None:
        return Response(status_code=499)
    if search is not None:  # the answer's citations of the results it was given
        answer = reply["choices"][0]["message"]
        answer["annotations"] = chat_annotations(search, answer["content"] or "")
    kept = kept_by(started)
    if kept is not None:
        await kept(reply["choices"][0]["message"])
    return JSONResponse(reply)


def _stream_error(failure: Failure) -> list[bytes]:
    """A stream's end when a tool round fails (the prompt grew past the context, ...)."""
    return [sse.event(openai_error(failure)), sse.DONE]


def _dumped(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [m.model_dump(exclude_none=True) for m in messages]


# Parameters OpenAI knows that this server does not support yet, with what to say about them.
_UNSUPPORTED = {
    "functions": "function calling is not supported by this server",
    "audio": "audio output is not supported by this server",
    "prediction": "predicted outputs are not supported by this server",
}


def _reject_unsupported(body: ChatCompletionRequest) -> None:
    for name, why in _UNSUPPORTED.items():
        value = getattr(body, name)
        if value is not None and value != []:
            raise bad_request(f"{name}: {why}", name)
    if body.function_call is not None and body.function_call != "none":
        raise bad_request(
            "function_call: the deprecated function calling is not supported; use tools",
            "function_call",
        )
    if body.modalities is not None and set(body.modalities) - {"text"}:
        others = ", ".join(sorted(set(body.modalities) - {"text"}))
        raise bad_request(
            f"modalities: this server outputs text only and cannot produce {others}",
            "modalities",
        )
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def _messages(messages: list[ChatMessage], fmt: ToolFormat) -> list[dict[str, Any]]:
    known_calls: dict[str, str] = {}  # ids of the assistant tool calls so far, to their names
    return [_message_dict(i, m, known_calls, fmt) for i, m in enumerate(messages)]


def _message_dict(
    index: int, message: ChatMessage, known_calls: dict[str, str], fmt: ToolFormat
) -> dict[str, Any]:
    content: str | list[dict[str, Any]] | None = message.content
    if isinstance(content, list):
        content = _content_of_parts(index, message.role, content)
    if isinstance(content, list):  # it holds media: a user turn, the template places them
        turn: dict[str, Any] = {"role": message.role, "content": content}
        return turn | ({"name": message.name} if message.name is not None else {})
    if content is None and message.role != "assistant":
        raise bad_request(f"messages.{index}.content is required", f"messages.{index}.content")
    if message.tool_calls or message.role == "tool":
        return history_turn(
            index,
            message.role,
            content or "",
            message.tool_calls,
            message.tool_call_id,
            known_calls,
            fmt,
        )
    out: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name is not None:
        out["name"] = message.name
    return out


def _content_of_parts(index: int, role: str, parts: list[dict[str, Any]]) -> str | list[Any]:
    """The text of the parts, joined; with images or audio (decode_request_media checks and
    decodes them next, in this order), the parts as the chat template takes them: text parts,
    ``{"type": "image"}``, ``{"type": "audio"}`` and ``{"type": "video"}`` where each goes."""
    out: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        kind = part.get("type")
        param = f"messages.{index}.content.{j}"
        if not isinstance(kind, str):
            raise bad_request(f"{param}.type must be a string", f"{param}.type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"{param}.text must be a string", f"{param}.text")
            out.append({"type": "text", "text": text})
        elif kind in ("image_url", "input_image") and role == "user":
            out.append({"type": "image"})
        elif kind in ("image_url", "input_image"):
            raise bad_request(f"{param}: images are accepted in user messages only", param)
        elif kind in ("input_audio", "audio_url") and role == "user":
            out.append({"type": "audio"})
        elif kind in ("input_audio", "audio_url"):
            raise bad_request(f"{param}: audio is accepted in user messages only", param)
        elif kind == "video_url" and role == "user":
            # decode_request_media has refused it unless the model takes video.
            out.append({"type": "video"})
        elif kind == "video_url":
            raise bad_request(f"{param}: videos are accepted in user messages only", param)
        elif kind == "file":
            raise bad_request(f"{param}: this model cannot accept {kind} parts", param)
        else:
            raise bad_request(f"{param}: unknown content part type {kind!r}", f"{param}.type")
    if any(p["type"] != "text" for p in out):
        return out
    return "".join(p["text"] for p in out)


def _sampling_params(body: ChatCompletionRequest, model: ServedModel) -> SamplingParams:
    both = body.max_tokens is not None and body.max_completion_tokens is not None
    if both and body.max_tokens != body.max_completion_tokens:
        raise bad_request(
            "max_tokens and max_completion_tokens disagree; send one", "max_completion_tokens"
        )
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    names = {"logprobs": "top_logprobs"}
    if body.max_tokens is None:
        names["max_tokens"] = "max_completion_tokens"
    return sampling_params(
        body,
        model,
        max_tokens=max_tokens if max_tokens is not None else 1,
        logprobs=logprobs,
        param_names=names,
    )


class _Completion:
    """Fields shared by every chunk of one completion."""

    def __init__(self, completion_id: str, created: int, model: str) -> None:
        self.id = completion_id
        self.created = created
        self.model = model

    def envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def _usage(
    num_prompt_tokens: int, num_output_tokens: int, reasoning_tokens: int | None = None
) -> dict[str, Any]:
    """``reasoning_tokens``: the output tokens a reasoning model spent thinking (None: the
    reply is not split, and no details are given)."""
    usage: dict[str, Any] = {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
    }
    if reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


def _logprobs(model: ServedModel, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": token_piece(model, token_id),
            "logprob": clamp(logprob),
            "bytes": list(model.tokenizer.id_to_bytes(token_id)),
        }

    content = [
        entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
        for lp in lps
    ]
    return {"content": content, "refusal": None}


async def _collect(
    request: Request,
    completion: _Completion,
    model: ServedModel,
    streams: list[AsyncIterator[RequestOutput]],
    num_prompt_tokens: int,
    calls: Callable[[], CallReader] | None,
    thinking: ReasoningSplit | None,
) -> dict[str, Any] | None:
    """Gather every choice, aborting them all if the client goes away first (None)."""
    gens = await collect(request, streams)
    if gens is None:
        return None
    want_logprobs = gens[0].final.logprobs is not None or any(g.logprobs for g in gens)
    body = completion.envelope("chat.completion")
    body["choices"] = [
        _choice(model, i, gen, want_logprobs, calls, thinking) for i, gen in enumerate(gens)
    ]
    reasoning = sum(g.final.reasoning_tokens for g in gens) if thinking is not None else None
    body["usage"] = _usage(
        num_prompt_tokens, sum(g.final.num_output_tokens for g in gens), reasoning
    )
    return body


def _choice(
    model: ServedModel,
    index: int,
    gen: Generation,
    want_logprobs: bool,
    calls: Callable[[], CallReader] | None,
    thinking: ReasoningSplit | None,
) -> dict[str, Any]:
    reply = _reply(gen.text, calls, thinking)
    finish = gen.final.finish_reason
    if reply.get("tool_calls"):
        finish = "tool_calls" if finish == "stop" else finish
    return {
        "index": index,
        "message": reply,
        "finish_reason": finish,
        "logprobs": _logprobs(model, gen.logprobs) if want_logprobs else None,
    }


def _reply(
    text: str, calls: Callable[[], CallReader] | None, thinking: ReasoningSplit | None
) -> dict[str, Any]:
    """A whole reply's message: its reasoning split off, its calls read."""
    reply: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if thinking is not None:  # the answer is what follows the reasoning
        reasoning, text = thinking.split(text)
        reply |= {"content": text, "reasoning_content": reasoning or None}
    if calls is not None:
        content, tool_calls = message(text, calls())
        if tool_calls:
            reply |= {"content": content, "tool_calls": tool_calls}
        else:  # a call cut short by max_tokens is dropped, not left in the text as its syntax
            reply["content"] = content
    return reply


async def _stream(
    completion: _Completion,
    model: ServedModel,
    streams: list[AsyncIterator[RequestOutput]],
    num_prompt_tokens: int,
    include_usage: bool,
    keepalive: float,
    calls: Callable[[], CallReader] | None,
    thinking: ReasoningSplit | None,
    kept: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
    annotate: Callable[[str], list[dict[str, Any]]] | None = None,
    timer: RequestTimer | None = None,
) -> AsyncIterator[bytes]:
    """``kept``: given the first choice's message once it has finished (a session's);
    ``annotate``: a choice's content -> its annotations, sent in a delta before its end;
    ``timer``: the request's (a shutdown's cut reports the usage it counted)."""
    readers = [StreamedCalls(calls()) for _ in streams] if calls is not None else None
    texts = [""] * len(streams)  # each choice's whole text, for ``kept``
    contents = [""] * len(streams)  # each choice's content as sent, for ``annotate``
    finished = [False] * len(streams)
    splitters = [thinking.splitter() for _ in streams] if thinking is not None else None
    reasoning_tokens = [0] * len(streams)  # each choice's, as its outputs come

    def chunk(index: int, delta: dict[str, Any], finish: str | None, lps: Any = None) -> bytes:
        body = completion.envelope("chat.completion.chunk")
        body["choices"] = [
            {"index": index, "delta": delta, "finish_reason": finish, "logprobs": lps}
        ]
        if include_usage:
            body["usage"] = None
        contents[index] += delta.get("content") or ""
        return sse.event(body)

    def annotations(index: int) -> Iterator[bytes]:
        found = annotate(contents[index]) if annotate is not None else []
        if found:
            yield chunk(index, {"annotations": found}, None)

    def on_output(index: int, out: RequestOutput) -> Iterator[bytes]:
        lps = _logprobs(model, visible_logprobs(out)) if out.logprobs is not None else None
        text = out.text
        if kept is not None:
            texts[index] += text
            finished[index] = out.finished
        reasoning_tokens[index] = out.reasoning_tokens
        if splitters is not None:  # reasoning first, as its own delta
            reasoning, text = splitters[index].feed(text)
            if out.finished:
                more_reasoning, more_text = splitters[index].finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
            if reasoning:
                yield chunk(index, {"reasoning_content": reasoning}, None, lps)
                lps = None
        if readers is not None:
            yield from with_calls(index, out, text, readers[index], lps)
            return
        if text or (lps and lps["content"]):
            yield chunk(index, {"content": text}, None, lps)
        if out.finished:
            yield from annotations(index)
            yield chunk(index, {}, out.finish_reason)

    def with_calls(
        index: int, out: RequestOutput, text: str, reader: StreamedCalls, lps: Any
    ) -> Iterator[bytes]:
        """Content and tool-call deltas; logprobs ride on the step's first delta."""
        deltas = list(reader.deltas(text))
        if out.finished:
            deltas += reader.finish()
        if not deltas and lps and lps["content"]:
            deltas = [{"content": ""}]
        for i, delta in enumerate(deltas):
            yield chunk(index, delta, None, lps if i == 0 else None)
        if out.finished:
            yield from annotations(index)
            finish = out.finish_reason
            yield chunk(index, {}, "tool_calls" if reader.called and finish == "stop" else finish)

    def usage(output_tokens: int) -> dict[str, Any]:
        body = completion.envelope("chat.completion.chunk")
        body["choices"] = []
        reasoning = sum(reasoning_tokens) if thinking is not None else None
        body["usage"] = _usage(num_prompt_tokens, output_tokens, reasoning)
        return body

    for index in range(len(streams)):
        yield chunk(index, {"role": "assistant", "content": ""}, None)
    async for event in stream_events(
        streams, keepalive, on_output, usage if include_usage else None, timer
    ):
        yield event
    if kept is not None and finished[0]:
        reply = _reply(texts[0], calls, thinking)
        sent = readers[0].ids if readers else []
        for call, call_id in zip(reply.get("tool_calls") or (), sent, strict=False):
            call["id"] = call_id  # the ids the stream sent
        await kept(reply)
