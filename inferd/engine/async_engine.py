"""AsyncEngine: runs EngineCore.step() off the event loop and streams outputs into asyncio.

Steps run on the engine's own thread, or, under `inferd serve`, on the main thread through a
``MainThreadDriver`` (engine/driver.py says why). Each request gets an asyncio.Queue. The
stepping thread never touches the event loop's objects
directly: it hands outputs over with ``call_soon_threadsafe``. Adds and aborts travel the other
way through a locked inbox, applied between steps. Leaving ``generate`` early (client gone,
task cancelled) aborts the request, which frees its KV blocks at the next step boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from inferd.engine.core import EngineCore
from inferd.engine.detokenizer import IncrementalDetokenizer
from inferd.engine.driver import active_driver
from inferd.engine.outputs import EngineStats, RequestOutput
from inferd.engine.request import Request
from inferd.engine.sampling import SamplingParams

log = logging.getLogger(__name__)


class AdmissionError(ValueError):
    """A request the engine can never serve (too long for the context or the KV pool)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineBusyError(RuntimeError):
    """The waiting queue is full; callers should retry later."""


class EngineStoppedError(RuntimeError):
    """The engine is shut down."""


@dataclass(frozen=True, slots=True)
class TextCodec:
    """What the engine needs of a tokenizer to build requests."""

    token_bytes: Callable[[int], bytes]
    special_ids: frozenset[int]
    eos_token_ids: frozenset[int]


@dataclass(slots=True)
class _Inbox:
    lock: threading.Lock = field(default_factory=threading.Lock)
    wake: threading.Event = field(default_factory=threading.Event)
    adds: list[Request] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)


class AsyncEngine:
    def __init__(self, core: EngineCore, codec: TextCodec, max_waiting: int = 256) -> None:
        self.core = core
        self.codec = codec
        self.max_waiting = max_waiting
        self._inbox = _Inbox()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput]]] = {}
        self._ids = itertools.count()
        self._stopped = threading.Event()
        self._retired = threading.Event()
        self._driver = active_driver()
        self._thread: threading.Thread | None = None
        if self._driver is not None:  # the main thread steps this engine (see engine/driver.py)
            self._inbox.wake = self._driver.wake
            self._driver.register(self)
        else:
            self._thread = threading.Thread(target=self._run, name="inferd-engine", daemon=True)
            self._thread.start()

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def check_admission(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise before streaming starts if this request can never run or must wait."""
        if self._stopped.is_set():
            raise EngineStoppedError("the engine is shut down")
        if num_prompt_tokens == 0:
            raise AdmissionError("the prompt is empty after tokenization", "messages")
        limit = self.core.max_model_len
        if num_prompt_tokens + params.max_tokens > limit:
            raise AdmissionError(
                f"this model's maximum context length is {limit} tokens, but the request asks for "
                f"{num_prompt_tokens} prompt tokens + {params.max_tokens} max_tokens = "
                f"{num_prompt_tokens + params.max_tokens}; shorten the prompt or lower max_tokens",
                "max_tokens",
            )
        capacity = self.core.scheduler.kv.capacity_tokens
        if num_prompt_tokens + params.max_tokens > capacity:
            raise AdmissionError(
                f"the request needs {num_prompt_tokens + params.max_tokens} tokens of KV cache but "
                f"the whole pool holds {capacity}; lower max_tokens or raise --kv-cache-tokens",
                "max_tokens",
            )
        if len(self._queues) >= self.max_waiting + self.core.scheduler.config.max_num_seqs:
            raise EngineBusyError("too many requests are waiting; retry shortly")

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Admit a request now (raising if it cannot be) and return the stream of its outputs.

        Admission is immediate so that queue limits count every accepted request, even one
        whose stream is not read yet. ``cache_salt`` keeps its prefix-cache entries private.
        """
        self.check_admission(len(prompt_token_ids), params)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._queues:
            raise AdmissionError(f"request id {rid!r} is already in flight")
        request = Request(
            request_id=rid,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            eos_token_ids=self.codec.eos_token_ids,
            cache_salt=cache_salt,
            detokenizer=IncrementalDetokenizer(
                self.codec.token_bytes, self.codec.special_ids, params.stop
            ),
        )
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
    ) -> AsyncIterator[RequestOutput]:
        """Submit and stream; leaving the loop early aborts the request."""
        stream = self.submit(prompt_token_ids, params, request_id, cache_salt)
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
        sched = self.core.scheduler
        return EngineStats(
            running=len(sched.running),
            waiting=len(sched.waiting),
            kv_blocks_used=sched.kv.pool.num_used,
            kv_blocks_total=sched.kv.pool.num_blocks - 1,
            preemptions=sched.num_preemptions,
            prompt_tokens=self.core.prompt_tokens,
            generated_tokens=self.core.generated_tokens,
            steps=self.core.steps,
            last_step_seconds=self.core.last_step_seconds,
            prefix_cache_queries=sched.kv.stats.queries,
            prefix_cache_hits=sched.kv.stats.hits,
        )

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        self._inbox.wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        elif threading.current_thread() is threading.main_thread():
            self._retire()  # the driver runs here, so no step can be in flight
        else:
            self._retired.wait(timeout)  # the driver retires it between two steps

    # -- engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped.is_set():
            if not self.run_once():
                self._inbox.wake.wait(timeout=0.5)
                self._inbox.wake.clear()
        self._deliver(self.core.fail_all("the engine shut down"))

    def run_once(self) -> bool:
        """Apply queued adds and aborts, then one step if there is work; True if anything ran."""
        if self._stopped.is_set():
            self._retire()
            return True
        outputs = self._drain_inbox()
        if not self.core.has_work:
            self._deliver(outputs)
            return bool(outputs)
        try:
            outputs += self.core.step()
        except Exception as exc:  # a broken step must not strand the waiting callers
            log.exception("engine step failed")
            outputs += self.core.fail_all(f"engine error: {type(exc).__name__}: {exc}")
        self._deliver(outputs)
        return True

    def _retire(self) -> None:
        """Driver mode: leave the driver and end every request still here."""
        if self._retired.is_set():
            return
        assert self._driver is not None
        self._driver.unregister(self)
        self._deliver(self.core.fail_all("the engine shut down"))
        self._retired.set()

    def _drain_inbox(self) -> list[RequestOutput]:
        with self._inbox.lock:
            adds, self._inbox.adds = self._inbox.adds, []
            aborts, self._inbox.aborts = self._inbox.aborts, []
        outputs: list[RequestOutput] = []
        for request in adds:
            self.core.add(request)
        for rid in aborts:
            out = self.core.abort(rid)
            if out is not None:
                outputs.append(out)
        return outputs

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            target = self._queues.get(output.request_id)
            if target is not None:
                loop, queue = target
                # A closed loop means nobody is listening any more.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(queue.put_nowait, output)


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
