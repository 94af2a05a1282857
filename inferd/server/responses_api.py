"""OpenAI's Responses API: POST /v1/responses (JSON, SSE, or ``background``), GET and DELETE
/v1/responses/{id}, GET /v1/responses/{id}/input_items, POST /v1/responses/{id}/cancel.

A request becomes a chat generation (responses_input.py: messages, tools, constraint), runs on
the same engine path as /v1/chat/completions, and its text becomes output items
(responses_output.py). Stored responses (``store``, the default) live in SQLite
(responses_store.py), owned by the API key that created them; ``previous_response_id`` rebuilds
the conversation from there. A stream sends typed events (``event: <type>``), each with a
``sequence_number`` counted from 0, and has no ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from inferd.agent.search import SearchTools
from inferd.server import sse
from inferd.server.agent_loop import Started, call_origin, start_reply
from inferd.server.agent_runtime import HostedSource, RanCall, ServerTools
from inferd.server.auth import request_owner
from inferd.server.constraints import answer_schema, checked_constraint
from inferd.server.errors import APIError, bad_request
from inferd.server.events import End, Failure, KeepAlive, Piece, events
from inferd.server.file_inputs import resolve_response_files
from inferd.server.generation import collect, sampling_params
from inferd.server.openai_tools import offer
from inferd.server.pipeline import ChatJob, ErrorNames, Prepared, prepare, submit_detached
from inferd.server.protocol import parse_body
from inferd.server.reasoning import ReasoningSplit
from inferd.server.responses_input import (
    ResponsesRequest,
    calls_of,
    chat_messages,
    check_request,
    echo_tools,
    hosted_mcp,
    input_items,
    media_messages,
    new_id,
    output_as_input,
    renamed,
    sampling_fields,
    text_config,
    tool_request,
)
from inferd.server.responses_output import (
    OutputBuilder,
    answered_calls,
    mcp_approval_request_item,
    mcp_call_item,
    mcp_list_tools_item,
    ran_events,
)
from inferd.server.responses_store import ResponseStore
from inferd.server.state import ServerState
from inferd.server.streams import close_stream
from inferd.server.web_search import (
    is_search,
    search_tool,
    url_citations,
    web_search_call_item,
)
from inferd.serving.interface import RequestOutput
from inferd.serving.served import ServedModel
from inferd.structured.tool_syntax.base import CallReader

CONTAINER_ID = "cntr_sandbox"  # the code execution sandbox, as container_file_citation names it
MAX_CHAIN = 10_000  # responses one previous_response_id chain may hold
_TERMINAL = ("completed", "incomplete", "failed", "cancelled")


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.inferd
    return state


def _not_found(response_id: str) -> APIError:
    return APIError(
        404, f"no response with id {response_id!r}", param="response_id", code="not_found"
    )


def _citations(
    search: SearchTools | None, server: ServerTools | None, text: str
) -> list[dict[str, Any]]:
    """An answer's annotations: the web pages it cites (with web search), then the files the
    request's code wrote and stored (container_file_citation: the span of the file's name in
    the answer, or the whole answer when it does not name it)."""
    found = url_citations(search, text) if search is not None else []
    for saved in server.saved_files if server is not None else ():
        name = saved.path.rsplit("/", 1)[-1]
        start = text.find(name)
        span = (start, start + len(name)) if start >= 0 else (0, len(text))
        found.append(
            {
                "type": "container_file_citation",
                "container_id": CONTAINER_ID,
                "file_id": saved.file_id,
                "filename": name,
                "start_index": span[0],
                "end_index": span[1],
            }
        )
    return found


# -- create -----------------------------------------------------------------------------------


async def create_response(request: Request) -> Response:
    state = _state(request)
    body = parse_body(await request.body(), ResponsesRequest)
    check_request(body)
    model = state.resolve_model(body.model)
    owner = request_owner(request)
    history = await asyncio.to_thread(_history, state.responses, body.previous_response_id, owner)
    items = input_items(body.input, calls_of(history))
    await resolve_response_files(request, items)  # input_file: an image or text part now
    hosted = hosted_mcp(body)
    if hosted and body.background:
        raise bad_request("background: mcp tools are run in the foreground only", "background")
    if body.background and search_tool(body.tools) is not None:
        raise bad_request("background: web search is run in the foreground only", "background")
    sources: list[HostedSource] = []
    try:  # the request's MCP servers: its loop closes them, or a failure here does
        for h in hosted:
            source = await state.agent.connect(
                h.server_label,
                h.server_url,
                h.headers,
                allowed=h.allowed_tools,
                never_ask=h.never_ask,
                param=f"tools.{h.index}.server_url",
            )
            sources.append(source)
        return await _respond(request, state, body, model, owner, history, items, sources)
    except BaseException:
        await asyncio.gather(*(s.source.close() for s in sources), return_exceptions=True)
        raise


async def _respond(
    request: Request,
    state: ServerState,
    body: ResponsesRequest,
    model: ServedModel,
    owner: str | None,
    history: list[dict[str, Any]],
    items: list[dict[str, Any]],
    hosted: list[HostedSource],
) -> Response:
    server = None
    if not body.background:  # a background response runs one round
        server = await state.agent.server_tools(
            body.max_tool_rounds,
            code_execution=body.enable_code_execution,
            hosted=hosted,
            save_files=state.files.sink(owner),
            search=search_tool(body.tools),
        )
    search = server.search if server is not None else None
    tools = tool_request(body, server.specs if server else ())
    fields = sampling_fields(body)
    fmt = model.tool_format
    loop = None
    if server is not None:  # a call needing approval is asked in the reply, answered in input
        loop = server.loop(model, tools, answer_schema(fields), defer_approvals=True)
    try:
        tool_constraint = (
            tools.constraint(fmt, answer_schema(fields)) if tools is not None else None
        )
        params = sampling_params(
            fields,
            model,
            max_tokens=body.max_output_tokens or 1,
            logprobs=None,
            param_names={"max_tokens": "max_output_tokens"},
        )
        constraint = await checked_constraint(fields, tool_constraint)
    except APIError as exc:
        raise renamed(exc) from None
    # the approvals this request answers: the calls run (or are refused) once every check passed
    answered = await answered_calls(loop, history, items, call_origin(request))
    messages, template_tools = offer(
        chat_messages(body.instructions, history + items + answered, fmt), tools, fmt
    )
    job = ChatJob(
        messages,
        media_messages(history + items),
        params,
        body.max_output_tokens,
        constraint,
        tools=template_tools,
        variables=_effort_variables(body.reasoning),
        truncate=body.truncation == "auto",
        names=ErrorNames(
            prompt_param="input",
            media=partial(_renamed_part, num_history=len(history)),
            prompt=_as_input,
            constraint=renamed,
            no_room="shorten the input or send truncation: auto",
        ),
    )
    if answered and loop is not None:  # the approved calls answered a forced tool choice
        job = replace(job, constraint=loop.later_constraint())
    response = _skeleton(body, model, tools is not None and tools.parallel)
    # The reply may hold tool calls: a reader of them, in the model's syntax.
    calls: Callable[[], CallReader] | None = (
        partial(tools.reader, fmt) if tools is not None and tool_constraint else None
    )
    if body.background:
        ready = await prepare(request, model, job)
        run = _Run(response, ready.prompt_tokens, calls, body.store is not False)
        run.thinking = ready.thinking
        return await _background(state, model, run, items, owner, ready)

    def run_of(started: Started) -> _Run:
        ready = started.ready
        calls_now = started.calls(fmt, calls)  # the loop's last round may call fewer tools
        run = _Run(response, ready.prompt_tokens, calls_now, body.store is not False)
        run.thinking = ready.thinking
        # the request's MCP servers' tools, then the calls the loop ran, before the answer
        run.ran = [
            *(mcp_list_tools_item(h) for h in hosted),
            *answered,
            *(_ran_item(c, search) for c in started.ran),
            *(mcp_approval_request_item(c) for c in started.awaiting),
        ]
        run.cite = partial(_citations, search, server)
        return run

    def stream_of(started: Started) -> AsyncIterator[bytes]:
        return _stream(state, run_of(started), items, owner, started.streams[0])

    if loop is None and server is not None:
        await server.close()  # the request's MCP servers, which no loop will use
    started = await start_reply(request, model, job, loop, body.stream, stream_of, _round_error)
    if isinstance(started, Response):
        return started
    run = run_of(started)
    gens = await collect(request, started.streams)
    if gens is None:
        return Response(status_code=499)
    (gen,) = gens
    builder = run.builder()
    builder.feed(gen.text)
    builder.finish(gen.final.finish_reason != "length")
    final = run.finished(builder, gen.final)
    if run.store:
        await asyncio.to_thread(state.responses.put, final, items, owner=owner)
    return JSONResponse(final)


def _ran_item(call: RanCall, search: SearchTools | None) -> dict[str, Any]:
    """A call the loop ran, as its output item: a search's ``web_search_call``, another
    tool's ``mcp_call``."""
    if search is not None and is_search(call):
        return web_search_call_item(call, search, new_id("ws"))
    return mcp_call_item(call)


def _history(
    store: ResponseStore, previous_id: str | None, owner: str | None
) -> list[dict[str, Any]]:
    """The conversation before this turn: each stored turn's input items and output, oldest
    first, following previous_response_id back to its start."""
    turns: list[list[dict[str, Any]]] = []
    current, param = previous_id, "previous_response_id"
    while current is not None:
        stored = store.get(current, owner)
        if stored is None:
            raise bad_request(
                f"previous_response_id: no stored response with id {current!r}"
                + ("" if current == previous_id else " (an earlier turn of this conversation)"),
                param,
                code="previous_response_not_found",
            )
        if stored.status not in _TERMINAL:
            raise bad_request(
                f"previous_response_id: the response {current!r} is still {stored.status}",
                param,
            )
        turns.append(store.input_items(current) + output_as_input(stored.body["output"]))
        current = stored.previous_id
        if len(turns) > MAX_CHAIN:
            raise bad_request(f"previous_response_id: a chain longer than {MAX_CHAIN}", param)
    return [item for turn in reversed(turns) for item in turn]


def _effort_variables(reasoning: dict[str, Any] | None) -> dict[str, object]:
    """``reasoning.effort`` for templates that take it: ``reasoning_effort`` as given, and
    ``enable_thinking`` (Qwen3) off for effort "none"; no effort leaves the defaults."""
    effort = (reasoning or {}).get("effort")
    if not isinstance(effort, str):
        return {}
    return {"reasoning_effort": effort, "enable_thinking": effort != "none"}


def _renamed_part(exc: APIError, num_history: int) -> APIError:
    """``messages.N...`` (N counting the stored turns' items first) as the input's path."""
    match = re.match(r"messages(?:\.(\d+))?", exc.param or "")
    if match is None:
        return exc
    if match.group(1) is None:  # the request as a whole (more images than the cap)
        old, new = "messages", "input"
    elif int(match.group(1)) < num_history:
        return APIError(exc.status, exc.message, "previous_response_id", exc.code, exc.headers)
    else:
        old, new = match.group(0), f"input.{int(match.group(1)) - num_history}"
    param = (exc.param or "").replace(old, new, 1)
    return APIError(exc.status, exc.message.replace(old, new, 1), param, exc.code, exc.headers)


def _as_input(exc: APIError) -> APIError:
    if exc.param != "messages":
        return exc
    return APIError(exc.status, exc.message.replace("messages", "input"), "input", exc.code)


def _skeleton(body: ResponsesRequest, model: ServedModel, parallel: bool) -> dict[str, Any]:
    """The response object before any output."""
    tool_choice = body.tool_choice if body.tool_choice is not None else "auto"
    return {
        "id": new_id("resp"),
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": bool(body.background),
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": None,
        "model": model.id,
        "output": [],
        "parallel_tool_calls": parallel if body.tools else body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": body.store is not False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": text_config(body.text),
        "tool_choice": tool_choice,
        "tools": echo_tools(body.tools),
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": body.truncation or "disabled",
        # no "usage" until it is known: the spec's ResponseUsage is an object, never null
        "metadata": body.metadata or {},
        # Fields OpenAI's Response object carries: no penalties or logprobs are applied on
        # this API, every request is served alike, and the two identifiers are echoed.
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "top_logprobs": 0,
        "service_tier": "default",
        "safety_identifier": body.safety_identifier,
        "prompt_cache_key": body.prompt_cache_key,
        "completed_at": None,  # a unix time once completed
    } | ({"user": body.user} if body.user is not None else {})


class _Run:
    """One response being generated: its object and how to finish it."""

    def __init__(
        self,
        response: dict[str, Any],
        prompt_tokens: int,
        calls: Callable[[], CallReader] | None,
        store: bool,
    ):
        self.response = response
        self.prompt_tokens = prompt_tokens
        self.calls = calls  # a new reader of the reply's tool calls; None when it holds none
        self.store = store
        self.thinking: ReasoningSplit | None = None  # how to split the reasoning off, if at all
        self.ran: list[dict[str, Any]] = []  # mcp_call items of the tools the server ran
        # an answer's text -> its url_citation annotations (a request with web search)
        self.cite: Callable[[str], list[dict[str, Any]]] | None = None

    def builder(self) -> OutputBuilder:
        splitter = self.thinking.splitter() if self.thinking is not None else None
        items = [dict(i) for i in self.ran]
        return OutputBuilder(self.reader(), items=items, thinking=splitter, cite=self.cite)

    def reader(self) -> CallReader | None:
        return self.calls() if self.calls is not None else None

    def snapshot(self, status: str) -> dict[str, Any]:
        return self.response | {"status": status}

    def finished(self, builder: OutputBuilder, last: RequestOutput) -> dict[str, Any]:
        cut = last.finish_reason == "length"
        return self.response | {
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "output": builder.items,
            "usage": self.usage(last.num_output_tokens, last.reasoning_tokens),
            "completed_at": None if cut else int(time.time()),
        }

    def failed(self, message: str, output_tokens: int = 0) -> dict[str, Any]:
        return self.response | {
            "status": "failed",
            "error": {"code": "server_error", "message": message},
            "usage": self.usage(output_tokens),
        }

    def usage(self, output_tokens: int, reasoning_tokens: int = 0) -> dict[str, Any]:
        """``reasoning_tokens``: the output tokens spent in a think block (engine/thinking.py)."""
        return {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": self.prompt_tokens + output_tokens,
        }


# -- streaming --------------------------------------------------------------------------------


def _error_event(failure: Failure) -> dict[str, Any]:
    """The ``error`` event that ends a stream which failed (its sequence number to be set)."""
    err = failure.error
    return {
        "type": "error",
        "code": err.code or "server_error",
        "message": err.message,
        "param": err.param,
    }


def _round_error(failure: Failure) -> list[bytes]:
    """A stream's end when a tool round fails, before the response was created."""
    return [sse.named_event("error", _error_event(failure) | {"sequence_number": 0})]


async def _stream(
    state: ServerState,
    run: _Run,
    items: list[dict[str, Any]],
    owner: str | None,
    outputs: AsyncIterator[RequestOutput],
) -> AsyncIterator[bytes]:
    counter = itertools.count()

    def send(payloads: list[dict[str, Any]]) -> Iterator[bytes]:
        for payload in payloads:
            payload["sequence_number"] = next(counter)
            yield sse.named_event(payload["type"], payload)

    opening = [
        {"type": "response.created", "response": run.snapshot("in_progress")},
        {"type": "response.in_progress", "response": run.snapshot("in_progress")},
    ]
    for chunk in send([*opening, *ran_events(run.ran)]):
        yield chunk
    builder = run.builder()
    async for event in events([outputs], state.keepalive_seconds):
        if isinstance(event, KeepAlive):
            yield sse.KEEPALIVE
        elif isinstance(event, Piece):
            for chunk in send(builder.feed(event.output.text)):
                yield chunk
        elif isinstance(event, Failure):
            if run.store:
                failed = run.failed(event.error.message, event.output_tokens)
                await asyncio.to_thread(state.responses.put, failed, items, owner=owner)
            for chunk in send([_error_event(event)]):
                yield chunk
        else:
            (last,) = event.finals
            tail = builder.finish(last.finish_reason != "length")
            final = run.finished(builder, last)
            if run.store:
                await asyncio.to_thread(state.responses.put, final, items, owner=owner)
            kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
            for chunk in send([*tail, {"type": kind, "response": final}]):
                yield chunk


# -- background -------------------------------------------------------------------------------


async def _background(
    state: ServerState,
    model: ServedModel,
    run: _Run,
    items: list[dict[str, Any]],
    owner: str | None,
    ready: Prepared,
) -> Response:
    """Store the response as queued, answer at once, and generate in a task of its own (not
    tied to this HTTP request: the client polls GET /v1/responses/{id})."""
    queued = run.snapshot("queued")
    # admitted first, so a refusal stores nothing that would stay queued
    outputs = submit_detached(model, ready, f"{queued['id']}-bg")
    try:
        await asyncio.to_thread(state.responses.put, queued, items, owner=owner, background=True)
    except BaseException:
        await close_stream(outputs)
        raise
    task = asyncio.ensure_future(_generate_in_background(state, run, outputs))
    jobs = state.background_jobs
    jobs[queued["id"]] = task
    task.add_done_callback(lambda _: jobs.pop(queued["id"], None))
    return JSONResponse(queued)


async def _generate_in_background(
    state: ServerState, run: _Run, outputs: AsyncIterator[RequestOutput]
) -> None:
    store = state.responses
    builder = run.builder()
    await asyncio.to_thread(store.update, run.snapshot("in_progress"), unless_status=_TERMINAL)
    final: dict[str, Any] = run.failed("the engine returned no output")
    try:
        async for event in events([outputs], None):
            if isinstance(event, Piece):
                builder.feed(event.output.text)
            elif isinstance(event, Failure):
                final = run.failed(event.error.message, event.output_tokens)
            elif isinstance(event, End):
                (last,) = event.finals
                builder.finish(last.finish_reason != "length")
                final = run.finished(builder, last)
    except asyncio.CancelledError:  # cancelled: the route has stored it so
        await close_stream(outputs)
        raise
    await asyncio.to_thread(store.update, final, unless_status=("cancelled",))


# -- stored responses -------------------------------------------------------------------------


async def retrieve_response(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    stored = await asyncio.to_thread(
        _state(request).responses.get, response_id, request_owner(request)
    )
    if stored is None:
        raise _not_found(response_id)
    return JSONResponse(stored.body)


async def delete_response(request: Request) -> Response:
    state, response_id = _state(request), request.path_params["response_id"]
    deleted = await asyncio.to_thread(state.responses.delete, response_id, request_owner(request))
    if not deleted:
        raise _not_found(response_id)
    job = state.background_jobs.get(response_id)
    if job is not None:
        job.cancel()
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


async def cancel_response(request: Request) -> Response:
    state, response_id = _state(request), request.path_params["response_id"]
    store = state.responses
    stored = await asyncio.to_thread(store.get, response_id, request_owner(request))
    if stored is None:
        raise _not_found(response_id)
    if not stored.background:
        raise bad_request(
            "only responses created with background: true can be cancelled", "response_id"
        )
    if stored.status in _TERMINAL:
        return JSONResponse(stored.body)
    cancelled = stored.body | {"status": "cancelled"}
    if not await asyncio.to_thread(store.update, cancelled, unless_status=_TERMINAL):
        current = await asyncio.to_thread(store.get, response_id, request_owner(request))
        if current is None:
            raise _not_found(response_id)
        return JSONResponse(current.body)  # it finished meanwhile
    job = state.background_jobs.get(response_id)
    if job is not None:
        job.cancel()
    return JSONResponse(cancelled)


async def list_input_items(request: Request) -> Response:
    state, response_id = _state(request), request.path_params["response_id"]
    query = request.query_params
    limit = _int_param(query.get("limit"), "limit", 20, 1, 100)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order must be asc or desc", "order")
    store = state.responses
    stored = await asyncio.to_thread(store.get, response_id, request_owner(request))
    if stored is None:
        raise _not_found(response_id)
    page = await asyncio.to_thread(
        lambda: store.item_page(
            response_id,
            limit=limit,
            descending=order == "desc",
            after=query.get("after"),
            before=query.get("before"),
        )
    )
    if page is None:
        raise bad_request("after and before must be ids of this response's input items")
    data = page.items
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": page.has_more,
        }
    )


def _int_param(raw: str | None, name: str, default: int, low: int, high: int) -> int:
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise bad_request(f"{name} must be an integer", name) from None
    if not low <= value <= high:
        raise bad_request(f"{name} must be between {low} and {high}, got {value}", name)
    return value
