"""The neutral event stream a protocol frames, and the one place engine failures get a status.

A request's engine streams (one per choice) become one stream of events in no protocol's
terms: ``Piece`` (an output of one choice, as it came), ``KeepAlive`` (``keepalive`` seconds
passed without one), then exactly one of ``End`` (every choice finished; their last outputs)
or ``Failure`` (the request failed after it started). Chat completions, text completions,
Anthropic messages and the Responses API each turn these into their own frames, so none of
them catches an engine error or reads a failed output itself.

``failure_of`` is the mapping, for a stream and for a reply that is not streamed: an engine
that cannot take the request is 503 (400 when the request is beyond its limits), a deadline
passing is 504, a LoRA adapter whose files changed is 409, the engine's own failure is 500 and
an abort 503.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from inferd.server import sse
from inferd.server.errors import APIError, bad_request
from inferd.server.limits import RequestTimeoutError
from inferd.server.streams import close_stream
from inferd.serving.interface import (
    ADAPTER_CHANGED,
    ADAPTER_UNAVAILABLE,
    AdmissionError,
    EngineBusyError,
    EngineStoppedError,
    RequestOutput,
)

ENGINE_ERRORS = (AdmissionError, EngineBusyError, EngineStoppedError)

# Failures the engine reports that are not its own: a LoRA adapter whose files changed on disk
# is the operator's to fix (409: loading it again is the way out), one that cannot be read now
# may come back (503).
_OUTPUT_ERROR_STATUS = {ADAPTER_CHANGED: 409, ADAPTER_UNAVAILABLE: 503}


@dataclass(frozen=True, slots=True)
class Piece:
    """One output of choice ``index``."""

    index: int
    output: RequestOutput


@dataclass(frozen=True, slots=True)
class KeepAlive:
    """Nothing came for ``keepalive`` seconds: a comment keeps the connection alive."""


@dataclass(frozen=True, slots=True)
class End:
    """Every choice finished; each one's last output, in choice order."""

    finals: tuple[RequestOutput, ...]

    @property
    def output_tokens(self) -> int:
        return sum(out.num_output_tokens for out in self.finals)


@dataclass(frozen=True, slots=True)
class Failure:
    """The request failed after it started. ``engine_fault``: the engine's own failure or an
    abort (not the request's, nor the operator's), which OpenAI's streams type
    ``server_error``; its ``error.code`` is then the finish reason (``error``, ``abort``)."""

    error: APIError
    engine_fault: bool = False
    output_tokens: int = 0  # generated before it failed, every choice together


Event = Piece | KeepAlive | End | Failure


def engine_error(exc: Exception) -> APIError:
    """The HTTP error for an engine that refused a request (ENGINE_ERRORS)."""
    if isinstance(exc, AdmissionError):
        return bad_request(str(exc), exc.param, code=exc.code)
    if isinstance(exc, EngineBusyError):
        return APIError(503, str(exc), headers={"Retry-After": "1"})
    return APIError(503, str(exc))


def output_error(out: RequestOutput) -> APIError:
    """The HTTP error for a failed ("error") or aborted output."""
    if out.finish_reason == "abort":
        return APIError(503, out.error or "the request was aborted")
    status = _OUTPUT_ERROR_STATUS.get(out.error_code or "", 500)
    param = "model" if out.error_code is not None else None
    return APIError(status, out.error or "the engine failed", param, out.error_code)


def failed(out: RequestOutput) -> bool:
    return out.finish_reason in ("error", "abort")


def failure_of(cause: Exception | RequestOutput, output_tokens: int = 0) -> Failure:
    """The failure a failed output or an exception raised while generating stands for."""
    if isinstance(cause, RequestOutput):
        err = output_error(cause)
        if cause.error_code is not None:
            return Failure(err, output_tokens=output_tokens)
        err = APIError(err.status, err.message, code=cause.finish_reason)
        return Failure(err, engine_fault=True, output_tokens=output_tokens)
    if isinstance(cause, APIError):
        return Failure(cause, output_tokens=output_tokens)
    if isinstance(cause, ENGINE_ERRORS):
        return Failure(engine_error(cause), output_tokens=output_tokens)
    if isinstance(cause, RequestTimeoutError):  # the deadline has aborted the generation
        err = APIError(504, str(cause), code="request_timeout")
        return Failure(err, output_tokens=output_tokens)
    return Failure(APIError(500, str(cause)), output_tokens=output_tokens)


async def events(
    streams: Sequence[AsyncIterator[RequestOutput]], keepalive: float | None
) -> AsyncIterator[Event]:
    """The choices' outputs as they come (with a ``KeepAlive`` whenever ``keepalive`` seconds
    pass without one; None: never), then ``End`` or one ``Failure``. Closing it aborts every
    engine request still running."""
    finals: list[RequestOutput | None] = [None] * len(streams)

    def spent() -> int:
        return sum(out.num_output_tokens for out in finals if out is not None)

    merged = interleave(streams)
    items = merged if keepalive is None else sse.with_heartbeat(merged, keepalive)
    try:
        async for item in items:
            if item is None:
                yield KeepAlive()
                continue
            index, out = item
            if failed(out):
                yield failure_of(out, spent())
                return
            finals[index] = out
            yield Piece(index, out)
    except Exception as exc:
        yield failure_of(exc, spent())
        return
    finally:  # the heartbeat first: it may be waiting on the merged stream
        await close_stream(items)
        await close_stream(merged)
    if any(out is None for out in finals):
        yield Failure(APIError(500, "the engine returned no output"), output_tokens=spent())
        return
    yield End(tuple(out for out in finals if out is not None))


async def interleave(
    streams: Sequence[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from all streams as they come; closing it aborts them all."""
    queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((index, out))
        except Exception as exc:
            queue.put_nowait((index, exc))
        else:
            queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
