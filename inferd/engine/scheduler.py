"""Token-budget scheduler: each step spends a token budget over running and waiting requests.

Every request has ``num_computed_tokens`` chasing ``num_tokens``. A decode needs one token, a
prompt needs many; a step gives each running request what it needs (capped by the budget), then
admits waiting requests with what is left. Long prompts are therefore prefilled in chunks and
never stall running decodes. When the KV pool runs dry, the newest running request is preempted:
its blocks are freed and it is recomputed later from its tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from inferd.config import EngineConfig
from inferd.engine.kv_cache import KVCacheManager
from inferd.engine.request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    request: Request
    start: int  # first token index computed in this step
    num_tokens: int

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the end of the request's tokens: a token is sampled."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def empty(self) -> bool:
        return not self.chunks


_DEFAULTS = EngineConfig()  # the engine's defaults live in one place


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = _DEFAULTS.max_num_seqs
    max_num_batched_tokens: int = _DEFAULTS.max_num_batched_tokens
    max_waiting: int = _DEFAULTS.max_waiting


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the queues for good and return its blocks."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if n == 0:
                continue  # waiting for its sampled token to be appended
            if not self._make_room(request, n, preempted):
                continue
            chunks.append(ScheduledChunk(request, request.num_computed_tokens, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            self.kv.attach_cached_prefix(request)
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.kv.allocate_slots(request, n):
                self.kv.free(request)  # give back the shared prefix while it waits
                request.num_computed_tokens = 0
                break  # new work never evicts running work
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chunks.append(ScheduledChunk(request, request.num_computed_tokens, n))
            budget -= n
        return SchedulerOutput(tuple(chunks), tuple(preempted))

    def _make_room(self, request: Request, n: int, preempted: list[str]) -> bool:
        while not self.kv.allocate_slots(request, n):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def advance(self, output: SchedulerOutput) -> None:
        """Record that the scheduled chunks were computed."""
        for chunk in output.chunks:
            chunk.request.num_computed_tokens = chunk.start + chunk.num_tokens
            self.kv.cache_full_blocks(chunk.request)
