"""AsyncEngine: an ``LLMEngine`` stepped off the event loop, its outputs streamed into asyncio.

Steps run wherever the engine's loop owner runs them (engine/driver.py): the main thread under
`inferd serve`, a thread of its own when embedded. Each request gets an asyncio.Queue. The
stepping thread never touches the event loop's objects directly: it hands outputs over with
``call_soon_threadsafe``. Adds, aborts and calls (``between_steps``: a weight swap) travel the
other way through a locked inbox, applied between steps. Leaving ``generate`` early (client
gone, task cancelled) aborts the request, which frees its KV blocks at the next step boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from inferd.engine.driver import EngineLoop
from inferd.engine.llm_engine import AdmissionError, LLMEngine, TextCodec
from inferd.engine.outputs import EngineStats, RequestOutput
from inferd.engine.request import MediaInput, Request
from inferd.engine.sampling import SamplingParams
from inferd.structured.compiler import GrammarCompiler

__all__ = [
    "AdmissionError",
    "AsyncEngine",
    "EngineBusyError",
    "EngineStoppedError",
    "RequestStream",
    "TextCodec",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


class EngineBusyError(RuntimeError):
    """The waiting queue is full; callers should retry later."""


class EngineStoppedError(RuntimeError):
    """The engine is shut down."""


@dataclass(frozen=True, slots=True)
class _Call(Generic[T]):
    """Work for the loop owner's thread between two steps, and where its result goes."""

    fn: Callable[[LLMEngine], T]
    result: Future[T]

    def run(self, engine: LLMEngine) -> None:
        if not self.result.set_running_or_notify_cancel():
            return
        try:
            self.result.set_result(self.fn(engine))
        except Exception as exc:  # the caller's to handle; the loop goes on
            self.result.set_exception(exc)


@dataclass(slots=True)
class _Inbox:
    wake: threading.Event
    lock: threading.Lock = field(default_factory=threading.Lock)
    adds: list[Request] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    calls: list[_Call[Any]] = field(default_factory=list)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, loop: EngineLoop) -> None:
        """``loop`` owns the stepping: this engine registers with it now."""
        self.engine = engine
        self.max_waiting = engine.scheduler_config.max_waiting
        self._loop = loop
        self._inbox = _Inbox(wake=loop.wake)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput]]] = {}
        self._ids = itertools.count()
        self._stopped = threading.Event()
        self._retired = threading.Event()
        loop.register(self)

    @property
    def codec(self) -> TextCodec:
        return self.engine.codec

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def grammars(self) -> GrammarCompiler | None:
        """Compiles this model's output constraints (None: constrained output unsupported)."""
        return self.engine.grammars

    def room(self, num_prompt_tokens: int) -> int:
        """The most tokens a request with this prompt may generate (``LLMEngine.room``)."""
        return self.engine.room(num_prompt_tokens)

    def check_admission(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise before streaming starts if this request can never run or must wait."""
        if self._stopped.is_set():
            raise EngineStoppedError("the engine is shut down")
        self.engine.check_request(num_prompt_tokens, params)
        if len(self._queues) >= self.max_waiting + self.engine.scheduler_config.max_num_seqs:
            raise EngineBusyError("too many requests are waiting; retry shortly")

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        media: Sequence[MediaInput] = (),
    ) -> RequestStream:
        """Admit a request now (raising if it cannot be) and return the stream of its outputs.

        Admission is immediate so that queue limits count every accepted request, even one
        whose stream is not read yet. ``cache_salt`` keeps its prefix-cache entries private.
        """
        self.check_admission(len(prompt_token_ids), params)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._queues:
            raise AdmissionError(f"request id {rid!r} is already in flight")
        request = self.engine.build_request(rid, prompt_token_ids, params, cache_salt, media)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[rid] = (asyncio.get_running_loop(), queue)
        with self._inbox.lock:
            self._inbox.adds.append(request)
        self._inbox.wake.set()
        return RequestStream(self, rid, queue)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        media: Sequence[MediaInput] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Submit and stream; leaving the loop early aborts the request."""
        stream = self.submit(prompt_token_ids, params, request_id, cache_salt, media)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def _release(self, request_id: str, finished: bool) -> None:
        self._queues.pop(request_id, None)
        if not finished:
            self.abort(request_id)

    def in_flight(self) -> list[str]:
        """Ids of admitted requests whose outputs someone still listens to, queued included."""
        return list(self._queues)

    def abort(self, request_id: str) -> None:
        with self._inbox.lock:
            self._inbox.aborts.append(request_id)
        self._inbox.wake.set()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def between_steps(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run ``fn(engine)`` on the loop owner's thread between two steps (now, when called
        there), after the adds and aborts queued before it: no step runs meanwhile. The
        future fails with EngineStoppedError if the engine shuts down first."""
        call = _Call(fn, Future())
        with self._inbox.lock:  # _retire fails the calls queued before it under this lock
            if self._stopped.is_set():
                call.result.set_exception(EngineStoppedError("the engine is shut down"))
                return call.result
            here = self._loop.on_loop_thread()
            if not here:
                self._inbox.calls.append(call)
        if here:
            call.run(self.engine)
        else:
            self._inbox.wake.set()
        return call.result

    def shutdown(self, timeout: float = 10.0) -> None:
        """End every request still here, leave the loop owner and close the engine."""
        self._stopped.set()
        self._inbox.wake.set()
        if self._loop.on_loop_thread():
            self._retire()  # the loop runs on this thread, so no step can be in flight
        else:
            self._retired.wait(timeout)  # the loop retires it between two steps
        self.engine.close()

    # -- the loop owner's thread -------------------------------------------------------------
    def run_once(self) -> bool:
        """Apply queued adds, aborts and calls, then one step if there is work; True if
        anything ran."""
        if self._stopped.is_set():
            self._retire()
            return True
        outputs = self._drain_inbox()
        if not self.engine.has_unfinished():
            self._deliver(outputs)
            return bool(outputs)
        try:
            outputs += self.engine.step()
        except Exception as exc:  # a broken step must not strand the waiting callers
            log.exception("engine step failed")
            outputs += self.engine.fail_all(f"engine error: {type(exc).__name__}: {exc}")
        self._deliver(outputs)
        return True

    def _retire(self) -> None:
        """Leave the loop owner, end every request still here and refuse the calls queued."""
        if self._retired.is_set():
            return
        self._loop.unregister(self)
        self._deliver(self.engine.fail_all("the engine shut down"))
        self._retired.set()
        with self._inbox.lock:
            calls, self._inbox.calls = self._inbox.calls, []
        for call in calls:
            if call.result.set_running_or_notify_cancel():  # not given up by its caller
                call.result.set_exception(EngineStoppedError("the engine is shut down"))

    def _drain_inbox(self) -> list[RequestOutput]:
        with self._inbox.lock:
            adds, self._inbox.adds = self._inbox.adds, []
            aborts, self._inbox.aborts = self._inbox.aborts, []
            calls, self._inbox.calls = self._inbox.calls, []
        outputs: list[RequestOutput] = []
        for request in adds:
            self.engine.add_built(request)
        for rid in aborts:
            out = self.engine.abort(rid)
            if out is not None:
                outputs.append(out)
        for call in calls:  # after the aborts: their blocks are free again
            call.run(self.engine)
        return outputs

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        # One hand-over per event loop and step, not one per output: each call_soon_threadsafe
        # writes to the loop's wake-up pipe, a system call on the stepping thread's path, and
        # 16 streams made 16 of them a step.
        batches: dict[asyncio.AbstractEventLoop, list[_Delivery]] = {}
        for output in outputs:
            target = self._queues.get(output.request_id)
            if target is not None:
                loop, queue = target
                batches.setdefault(loop, []).append((queue, output))
        for loop, batch in batches.items():
            # A closed loop means nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_put_all, batch)


_Delivery = tuple["asyncio.Queue[RequestOutput]", RequestOutput]


def _put_all(batch: list[_Delivery]) -> None:
    """On the event loop: each output into its request's queue, in the step's order."""
    for queue, output in batch:
        queue.put_nowait(output)


class RequestStream:
    """The outputs of one admitted request. Closing it, or dropping it unread, aborts it."""

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue[RequestOutput]):
        self.request_id = request_id
        self._engine: AsyncEngine | None = engine
        self._queue = queue
        self._finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished or self._engine is None:
            raise StopAsyncIteration
        try:
            output = await self._queue.get()
        except asyncio.CancelledError:  # whoever waited is gone: stop the work too
            self.close()
            raise
        if output.finished:
            self._finished = True
            self.close()
        return output

    def close(self) -> None:
        """Stop listening; an unfinished request is aborted and its KV blocks freed."""
        if self._engine is not None:
            self._engine._release(self.request_id, self._finished)
            self._engine = None

    def __del__(self) -> None:
        self.close()
