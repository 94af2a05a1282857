"""The agent loop: the server runs the model's calls to its own tools and generates again.

``generate`` is the pipeline's last step for chat completions, Anthropic messages and the
Responses API. Without a loop (``ToolLoop``: agent_runtime.py) it prepares and submits the job
as is. With one, each round is generated to its end; when the reply calls only tools the
server runs, the calls run (side by side, under each source's cap, after any approval they
need), the assistant's calls and the tools' results are appended to the conversation in the
model's own format, and the next round is generated, reusing the earlier rounds' KV blocks
through the prefix cache. The loop ends with a round that answers, calls a tool the client
runs, is cut short, or comes after ``max_rounds`` tool rounds (run without the server's tools);
that round is what the protocol returns, replayed as a stream, so its code is the same with
and without a loop. On the Responses API a call that needs approval ends the loop instead
(``Started.awaiting``): the reply asks, and a next request answers. Usage counts every round:
the prompt tokens of each, and the output tokens of all.

A request that asked for web search (``ToolLoop.search``) has the server search for the user's
last message before the first round, the call and its results put in the conversation as if
the model had made it (OpenAI's search models always search), and ``RanCall`` round 0.

A tool's failure, timeout or refusal is a result the model reads, never an HTTP error. Tool
output is untrusted: bounded by its source, and its chat-template control text broken
(agent/untrusted.py), so it cannot close the tool turn or open a call. A client that leaves
aborts the round or cancels the calls in flight. The client sees the final answer only; the
rounds before it show in the server's log, and, in a stream that asks for them
(``agent_progress``: chat completions and Anthropic messages), as ``agent_*`` events
(``Progress``) before the answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from inferd.agent.search import MAX_QUERY_CHARS, TOOL_NAME
from inferd.agent.tools import ToolResult
from inferd.agent.untrusted import neutralize
from inferd.server import sse
from inferd.server.agent_runtime import RanCall, ToolLoop
from inferd.server.approvals import CallOrigin, PendingApproval
from inferd.server.auth import request_owner
from inferd.server.errors import APIError
from inferd.server.events import Failure, failure_of
from inferd.server.generation import SSE_HEADERS, Generation, collect, unless_disconnected
from inferd.server.limits import RequestTimeoutError
from inferd.server.openai_tools import (
    ToolRequest,
    assistant_calls,
    message,
    new_call_id,
    tool_result,
)
from inferd.server.pipeline import ChatJob, Prepared, prepare, submit
from inferd.serving.interface import RequestOutput
from inferd.serving.served import ServedModel
from inferd.structured.tool_syntax import CallReader, ToolFormat

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Started:
    """A job's last round started: its prepared form, its engine streams, and the calls the
    loop ran before it (in order)."""

    ready: Prepared
    streams: list[AsyncIterator[RequestOutput]]
    ran: tuple[RanCall, ...] = ()
    # The last round ran without the server's tools (``max_tool_rounds`` reached): what it
    # could call instead (the client's tools, or None).
    narrowed: bool = False
    final_tools: ToolRequest | None = None
    # Calls waiting for approval (``ToolLoop.defer_approvals``): the loop stopped before them,
    # and the last round's stream holds no text.
    awaiting: tuple[RanCall, ...] = ()

    def calls(
        self, fmt: ToolFormat, offered: Callable[[], CallReader] | None
    ) -> Callable[[], CallReader] | None:
        """What makes a reader of the reply's calls: ``offered`` (the request's), unless the
        last round could call the client's tools only."""
        if not self.narrowed:
            return offered
        return partial(self.final_tools.reader, fmt) if self.final_tools is not None else None


# A result's text in a progress event is cut to this many characters (the model reads it whole).
PROGRESS_OUTPUT_CHARS = 4096


@dataclass(slots=True)
class Progress:
    """What the rounds do, for a stream that asked to see it (``agent_progress``): notes the
    stream sends, in order, as server-sent events named by their ``type``: ``agent_tool_call``
    when a call starts, ``agent_approval_request`` when it waits for a person (its
    ``approval_id`` is the one to answer at /v1/agent/approvals/{id}), ``agent_tool_result``
    when it has its result."""

    notes: asyncio.Queue[dict[str, Any]] = field(default_factory=asyncio.Queue)

    def note(self, kind: str, **fields: Any) -> None:
        self.notes.put_nowait({"type": f"agent_{kind}", **fields})

    def frames(self) -> Iterable[bytes]:
        """The notes not sent yet, as events."""
        while not self.notes.empty():
            yield _note_frame(self.notes.get_nowait())


def _note_frame(note: dict[str, Any]) -> bytes:
    return sse.named_event(note["type"], note)


async def generate(
    request: Request,
    model: ServedModel,
    job: ChatJob,
    loop: ToolLoop | None,
    first: Prepared | None = None,
    progress: Progress | None = None,
) -> Started | None:
    """The job prepared and its engine streams; None when the client left during the loop.
    ``first``: the job prepared already (``after_rounds``)."""
    if loop is None:
        ready = first or await prepare(request, model, job)
        return Started(ready, submit(request, model, ready))
    try:
        return await _rounds(request, model, job, loop, first, progress)
    finally:
        await loop.close()


async def start_reply(
    request: Request,
    model: ServedModel,
    job: ChatJob,
    loop: ToolLoop | None,
    stream: bool | None,
    stream_of: Callable[[Started], AsyncIterator[bytes]],
    error: Callable[[Failure], Iterable[bytes]],
    progress: bool = False,
) -> Started | Response:
    """The job started, for a protocol to collect; or, for a streamed reply, the response
    (``stream_of`` frames the last round, ``error`` a round's failure; ``progress``: the
    rounds' progress events first). A 499 when the client left during the rounds."""
    if stream and loop is not None:  # the rounds run inside the stream
        first = await prepare(request, model, job)
        notes = Progress() if progress else None
        rounds = partial(generate, request, model, job, loop, first, notes)
        keepalive = request.app.state.inferd.keepalive_seconds
        frames = after_rounds(rounds, keepalive, error, stream_of, notes)
        return StreamingResponse(frames, media_type="text/event-stream", headers=SSE_HEADERS)
    started = await generate(request, model, job, loop)
    if started is None:
        return Response(status_code=499)  # the client left during the tool rounds
    if stream:
        frames = stream_of(started)
        return StreamingResponse(frames, media_type="text/event-stream", headers=SSE_HEADERS)
    return started


async def after_rounds(
    rounds: Callable[[], Awaitable[Started | None]],
    keepalive: float,
    error: Callable[[Failure], Iterable[bytes]],
    then: Callable[[Started], AsyncIterator[bytes]],
    progress: Progress | None = None,
) -> AsyncIterator[bytes]:
    """A streamed reply whose tool rounds run inside the stream: keep-alive comments while
    they run (a long tool call or approval must not look like a dead connection), or the
    ``progress`` events as they come, then the last round's stream (``then``). A round's
    error is the stream's (``error``: the protocol's frames for it); so the first round is
    prepared before the stream starts, and what is wrong with the request itself is still
    its HTTP status."""
    task = asyncio.ensure_future(rounds())
    try:
        while not task.done():
            note = asyncio.ensure_future(progress.notes.get()) if progress else None
            waited = {task, note} if note is not None else {task}
            await asyncio.wait(waited, timeout=keepalive, return_when=asyncio.FIRST_COMPLETED)
            if note is not None and note.done():
                yield _note_frame(note.result())
                continue
            if note is not None:
                note.cancel()  # nothing taken from the queue: a cancelled get loses no note
            if not task.done():
                yield sse.KEEPALIVE
        for frame in progress.frames() if progress else ():
            yield frame
        started = task.result()
    except Exception as exc:
        if not isinstance(exc, (APIError, RequestTimeoutError)):
            log.exception("a tool round failed")
        for frame in error(failure_of(exc)):
            yield frame
        return
    finally:  # the client left (the stream is closed): the rounds stop
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if started is not None:
        async for frame in then(started):
            yield frame


async def _rounds(
    request: Request,
    model: ServedModel,
    job: ChatJob,
    loop: ToolLoop,
    first: Prepared | None,
    progress: Progress | None,
) -> Started | None:
    earlier_prompt = earlier_output = 0
    decoded = None
    ran: list[RanCall] = []
    clock = _Clock()
    opening = _opening_search(job, loop)
    if opening:  # the search before the model's first round, its results in the prompt
        results = await unless_disconnected(request, _run(request, loop, opening, -1, progress))
        clock.lap("tools")
        if results is None:
            return None
        ran += [_ran(loop, c, r, 0) for c, r in zip(opening, results, strict=True)]
        job = replace(job, messages=[*job.messages, *_turns(loop, "", opening, results)])
        first = None  # prepared without the results
    for round_index in range(loop.max_rounds + 1):
        if round_index == 0 and first is not None:
            ready = first
        else:
            ready = await prepare(request, model, job, decoded)
        gens = await collect(request, submit(request, model, ready))
        clock.lap("model")
        if gens is None:
            return None
        (gen,) = gens
        content, calls = _calls(gen, ready, loop)
        left = None if job.max_tokens is None else job.max_tokens - gen.final.num_output_tokens
        if (
            not calls
            or round_index == loop.max_rounds
            or gen.final.finish_reason != "stop"
            or not all(loop.runs(c["function"]["name"]) for c in calls)
            or (left is not None and left < 1)
        ):
            final = replace(ready, earlier_prompt_tokens=earlier_prompt)
            narrowed = round_index == loop.max_rounds and round_index > 0
            if ran:
                log.info(
                    "agent loop: %d tool round(s), %d call(s); model %.3f s, tools %.3f s, "
                    "total %.3f s (request %s)",
                    round_index,
                    len(ran),
                    clock.spent["model"],
                    clock.spent["tools"],
                    clock.total,
                    _request_id(request),
                )
            outputs = [_replay(gen.outputs, earlier_output)]
            return Started(final, outputs, tuple(ran), narrowed, loop.final_tools())
        asking = [c for c in calls if loop.defer_approvals and loop.asks(c["function"]["name"])]
        calls = [c for c in calls if c not in asking]  # the others run now
        earlier_prompt += len(ready.prompt)
        earlier_output += gen.final.num_output_tokens
        clock.lap("model")  # reading the calls
        run = _run(request, loop, calls, round_index, progress)
        results = await unless_disconnected(request, run)
        clock.lap("tools")
        if results is None:
            return None
        number = round_index + (1 if opening else 0)  # the opening search is round 0
        ran += [_ran(loop, c, r, number) for c, r in zip(calls, results, strict=True)]
        if asking:  # the reply asks for approval; a next request answers and goes on
            pending = tuple(_ran(loop, c, ToolResult(""), number) for c in asking)
            silent = replace(gen.final, text="", token_ids=(), logprobs=None)
            final = replace(ready, earlier_prompt_tokens=earlier_prompt - len(ready.prompt))
            replay = [_replay([silent], earlier_output - gen.final.num_output_tokens)]
            return Started(final, replay, tuple(ran), awaiting=pending)
        job = _next_round(job, loop, job.prefill + (content or ""), calls, results, left)
        if round_index + 1 == loop.max_rounds:  # the last round: the server runs no more
            job = replace(job, constraint=loop.final_constraint())
        elif round_index == 0:
            job = replace(job, constraint=loop.later_constraint())
        decoded = ready.decoded
    raise AssertionError("the last round always returns")


def _calls(
    gen: Generation, ready: Prepared, loop: ToolLoop
) -> tuple[str | None, list[dict[str, Any]]]:
    """A round's answer text and its calls (OpenAI's shape); reasoning is not kept."""
    text = gen.text if ready.thinking is None else ready.thinking.split(gen.text)[1]
    return message(text, loop.offered.reader(loop.fmt))


async def _run(
    request: Request,
    loop: ToolLoop,
    calls: Sequence[dict[str, Any]],
    round_index: int,
    progress: Progress | None,
) -> list[ToolResult]:
    """A round's calls, side by side; each one's start, approval and result noted in
    ``progress``."""
    origin = call_origin(request)

    async def one(call: Mapping[str, Any]) -> ToolResult:
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        if progress is None:
            return await call_tool(loop, name, arguments, origin)
        about = {"round": round_index + 1, "call_id": call["id"], "name": name}
        progress.note("tool_call", **about, arguments=arguments)

        def waiting(pending: PendingApproval) -> None:
            expires = int(pending.expires)
            progress.note("approval_request", **about, approval_id=pending.id, expires_at=expires)

        result = await call_tool(loop, name, arguments, origin, on_pending=waiting)
        output = result.content[:PROGRESS_OUTPUT_CHARS]
        progress.note(
            "tool_result",
            **about,
            is_error=result.is_error,
            output=output,
            output_truncated=len(output) < len(result.content),
            duration_ms=round(result.duration_s * 1000, 1),
        )
        return result

    return list(await asyncio.gather(*(one(c) for c in calls)))


async def call_tool(
    loop: ToolLoop,
    name: str,
    arguments_json: str,
    origin: CallOrigin,
    *,
    approved: bool = False,
    on_pending: Callable[[PendingApproval], None] | None = None,
) -> ToolResult:
    """One call of the loop, its arguments as the model wrote them; a call that needs
    approval waits for it first (``on_pending`` told of it), unless ``approved`` already
    (the Responses API's flow)."""
    try:
        arguments = json.loads(arguments_json or "{}")
    except ValueError:
        return ToolResult(f"the arguments of {name} are not valid JSON", True)
    if not isinstance(arguments, dict):
        return ToolResult(f"the arguments of {name} must be a JSON object", True)
    if not approved and loop.asks(name):
        decision = await loop.broker.ask(name, arguments, origin, on_pending)
        if decision != "approved":
            log.info("tool %s: %s (request %s)", name, decision, origin.request_id)
            return ToolResult(f"the call to {name} was not approved ({decision})", True)
    result = await loop.box.call(name, arguments, allowed=loop.allowed)
    log.info(
        "tool %s: %.3f s%s (request %s)",
        name,
        result.duration_s,
        ", error" if result.is_error else "",
        origin.request_id,
    )
    return result


def _request_id(request: Request) -> str:
    return str(getattr(request.state, "request_id", ""))


def call_origin(request: Request) -> CallOrigin:
    """Whom ``request``'s tool calls are made for: it, its key's owner, its session."""
    return CallOrigin(
        _request_id(request),
        request_owner(request),
        getattr(request.state, "agent_session", None),  # set by a request continuing one
    )


class _Clock:
    """Where a loop's time went: the model's rounds (prompt, generation), the tools' calls,
    and in total (the rest is assembling the next round)."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.spent = {"model": 0.0, "tools": 0.0}

    def lap(self, what: str) -> None:
        now = time.perf_counter()
        self.spent[what] += now - self.last
        self.last = now

    @property
    def total(self) -> float:
        return time.perf_counter() - self.start


def _ran(loop: ToolLoop, call: Mapping[str, Any], result: ToolResult, number: int) -> RanCall:
    name = call["function"]["name"]
    spec = loop.box.spec(name)
    source = spec.source if spec is not None else ""
    return RanCall(call["id"], name, call["function"]["arguments"], result, source, number)


def _next_round(
    job: ChatJob,
    loop: ToolLoop,
    content: str,
    calls: Sequence[dict[str, Any]],
    results: Sequence[ToolResult],
    left: int | None,
) -> ChatJob:
    """The job of the next round: the calls and their results appended, the output budget
    what the earlier rounds left of ``max_tokens``."""
    turns = _turns(loop, content, calls, results)
    job = replace(job, messages=[*job.messages, *turns], prefill="")
    if left is not None:
        job = replace(job, max_tokens=left, params=replace(job.params, max_tokens=left))
    return job


def _turns(
    loop: ToolLoop, content: str, calls: Sequence[dict[str, Any]], results: Sequence[ToolResult]
) -> list[dict[str, Any]]:
    """The assistant's turn making ``calls`` (after ``content``) and the tools' results, in
    the model's format; the results' control text broken."""
    fmt = loop.fmt
    made = [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
    turns = [assistant_calls(content, made, fmt)]
    for (call_id, name, _), result in zip(made, results, strict=True):
        text = neutralize(result.content, loop.control)
        turns.append(tool_result(call_id, name, f"error: {text}" if result.is_error else text, fmt))
    return turns


def _opening_search(job: ChatJob, loop: ToolLoop) -> list[dict[str, Any]]:
    """The web search the server makes before the model's first round (a request that asked
    for web search): for the text of the last user message, if it has any."""
    if loop.search is None:
        return []
    query = ""
    for turn in reversed(job.messages):
        if turn.get("role") == "user":
            content = turn.get("content")
            parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
            query = " ".join(str(p.get("text") or "") for p in parts if p.get("type") == "text")
            break
    if not query.strip():
        return []
    arguments = json.dumps({"query": query.strip()[:MAX_QUERY_CHARS]}, ensure_ascii=False)
    return [
        {
            "id": new_call_id(),
            "type": "function",
            "function": {"name": TOOL_NAME} | {"arguments": arguments},
        }
    ]


async def _replay(outputs: list[RequestOutput], earlier: int) -> AsyncIterator[RequestOutput]:
    """A round's outputs again, counting the output tokens of the rounds before it."""
    for out in outputs:
        yield replace(out, num_output_tokens=out.num_output_tokens + earlier) if earlier else out
