"""Token-budget scheduler: each step spends a token budget over running and waiting requests.

Every request has ``num_computed_tokens`` chasing ``num_tokens``. A decode needs one token, a
prompt needs many. A step serves, in this order:

1. every running decode (one token each), so long prompts never stall generation;
2. running prefills, in chunks capped by the budget, less a reserve for waiting requests whose
   whole prompt fits in one step (at most half the budget): a short request arriving while a
   long prompt is being prefilled starts at the next step instead of after the long one;
3. waiting requests in arrival order, with one fairness rule: only one *long* prefill (more
   tokens than one step's budget) runs at a time. Other long ones keep their place in the
   queue while shorter requests behind them are admitted, so a burst of long prompts (one API
   request with ``n`` choices of a 4,000-token prompt) cannot fill every seat and the budget;
   and the later copies of the same prompt find the first one's blocks in the prefix cache.

Media are encoded within an encoder budget per step (engine/encoder_budget.py): a chunk that
would start encoding past it stops before that image or clip, which waits for a later step.

A request with bidirectional spans (Gemma 3's images) has its chunks moved so none ends inside
one: it ends before the span, or, when the chunk starts in it or at it, after the whole span
even past the budget (the span's first rows must see its last keys, all computed in one step).
The encoder budget cuts only at an image's first placeholder, so it never splits a span.

A request with a LoRA adapter is admitted only once its adapter is resident (engine/lora_slots.py,
``--max-loras``); while every adapter slot is held by running requests it waits, keeping its
place, and requests behind it with resident adapters (or none) go first.

When the KV pool runs dry, the newest running request is preempted: its blocks are freed and it
is recomputed later from its tokens.

``max_decode_steps_before_prefill`` (N; mistral.rs's knob, unset by default): with decodes
running, prompt work (running prefills' chunks and admissions) joins a step only when it is due,
as mistral.rs decides between a prompt step and a decode step: never in the step right after
one that ran prompt work, then as soon as all of it completes within the step's budget (a short
prompt), else once N steps of decodes alone have run. So a long prompt is prefilled one chunk
every N + 1 steps, and the decodes' steps are slowed by prompt work at most every other step.
(mistral.rs never batches prompts with decodes; here a prompt step still runs the decodes.)

``no_kv_cache``: once a chunk has sampled a token its request's blocks are freed and its
computed count goes back to 0, so every token recomputes the whole sequence (prompt and output
so far), chunked by the budget as a prompt is; nothing is registered in the prefix cache.

Speculation (engine/speculative.py): a decode may carry drafted tokens after its last one; the
chunk then computes them too, and ``settle`` records how many the model accepted and gives back
the blocks of the rest. Drafts never preempt anyone: without room for them a decode goes alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from inferd.config import EngineConfig
from inferd.engine.encoder_budget import EncoderBudget
from inferd.engine.encoder_cache import EncoderCache
from inferd.engine.kv_cache import KVCacheManager
from inferd.engine.lora_slots import AdapterLoadError, LoraSlots
from inferd.engine.request import Request, RequestStatus
from inferd.engine.speculative import Speculator


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    request: Request
    start: int  # first token index computed in this step
    num_tokens: int  # the drafts included
    draft: tuple[int, ...] = ()  # speculated tokens after the request's last one

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the end of the request's tokens: a token is sampled
        (one per row from its last token on, when it carries drafts)."""
        return self.start + self.num_tokens - len(self.draft) == self.request.num_tokens

    def token_ids(self) -> list[int]:
        """The input tokens of the chunk's rows: the request's, then the drafts."""
        real = range(self.start, self.start + self.num_tokens - len(self.draft))
        return [*(self.request.token_at(p) for p in real), *self.draft]


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...] = ()
    # waiting requests whose adapter could not be loaded, with why: they end with an error
    failed: tuple[tuple[Request, AdapterLoadError], ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def empty(self) -> bool:
        return not self.chunks and not self.failed


_DEFAULTS = EngineConfig()  # the engine's defaults live in one place


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = _DEFAULTS.max_num_seqs
    max_num_batched_tokens: int = _DEFAULTS.max_num_batched_tokens
    max_waiting: int = _DEFAULTS.max_waiting
    # Encoder output rows a step may compute (engine/encoder_budget.py); None: the token budget.
    max_encoder_tokens: int | None = _DEFAULTS.max_encoder_tokens
    # With decodes running, steps of decodes alone before prompt work must join (module doc);
    # None: prompt work joins every step.
    max_decode_steps_before_prefill: int | None = _DEFAULTS.max_decode_steps_before_prefill
    no_kv_cache: bool = _DEFAULTS.no_kv_cache  # every token recomputes its sequence (module doc)

    @property
    def encoder_tokens(self) -> int:
        return self.max_encoder_tokens or self.max_num_batched_tokens


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        encoder_cache: EncoderCache | None = None,
        speculator: Speculator | None = None,
        adapters: LoraSlots | None = None,
    ) -> None:
        """``encoder_cache``: the runner's, so cached media cost no encoder budget.
        ``adapters``: which LoRA adapters are resident (None: whatever is attached runs)."""
        self.config = config
        self.kv = kv
        self.encoder_cache = encoder_cache
        self.speculator = speculator  # None: speculative decoding is off
        self.adapters = adapters if adapters is not None else LoraSlots()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.decode_steps = 0  # steps of decodes alone since prompt work last ran

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
        if self.speculator is not None:
            self.speculator.forget(request.request_id)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        failed: list[tuple[Request, AdapterLoadError]] = []
        encoder = EncoderBudget(self.config.encoder_tokens, self._is_encoded)
        decodes = [r for r in self.running if _remaining(r) == 1]
        prefills = [r for r in self.running if _remaining(r) > 1]
        prompts = self._prompts_due(decodes, prefills)
        drafts = self._drafts(decodes, prompts_pending=prompts and bool(prefills or self.waiting))
        budget = self._schedule_running(decodes, budget, chunks, preempted, encoder, drafts)
        decoded = len(chunks)
        if prompts:
            self._admit_prompts(prefills, budget, chunks, preempted, failed, encoder)
        alone = 0 < decoded == len(chunks)  # decodes ran, and no prompt work
        self.decode_steps = self.decode_steps + 1 if alone else 0
        return SchedulerOutput(tuple(chunks), tuple(preempted), tuple(failed))

    def _prompts_due(self, decodes: list[Request], prefills: list[Request]) -> bool:
        """Whether prompt work may join this step (module doc: max_decode_steps_before_prefill)."""
        limit = self.config.max_decode_steps_before_prefill
        if limit is None or not decodes or not (prefills or self.waiting):
            return True
        if self.decode_steps == 0:
            return False  # the last step ran prompt work: this one decodes alone
        left = self.config.max_num_batched_tokens - len(decodes)
        pending = sum(map(_remaining, prefills)) or _remaining(self.waiting[0])
        return pending <= left or self.decode_steps >= limit

    def _admit_prompts(
        self,
        prefills: list[Request],
        budget: int,
        chunks: list[ScheduledChunk],
        preempted: list[str],
        failed: list[tuple[Request, AdapterLoadError]],
        encoder: EncoderBudget,
    ) -> None:
        """Chunks of the running prefills, then of waiting requests, within ``budget``."""
        reserve = min(self._short_waiting_tokens(), budget // 2)
        left = self._schedule_running(prefills, budget - reserve, chunks, preempted, encoder)
        budget = left + reserve
        long_in_flight = any(_remaining(r) > self.config.max_num_batched_tokens for r in prefills)
        for request in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if long_in_flight and _remaining(request) > self.config.max_num_batched_tokens:
                continue  # one long prefill at a time; it keeps its place in the queue
            if not self._adapter_resident(request, failed):
                continue  # every adapter slot is busy (or it failed): it keeps its place
            self.kv.attach_cached_prefix(request)
            need = _remaining(request)
            n = _whole_spans(request, min(need, budget))
            fit = encoder.fit(request, request.num_computed_tokens, n)
            if fit < n:
                exhausted = encoder.exhausted
                encoder.close()
                if fit == 0 or exhausted:  # its media wait; those of requests before go first
                    self.kv.free(request)
                    request.num_computed_tokens = 0
                    continue
                n = fit
            if not self.kv.allocate_slots(request, n):
                self.kv.free(request)  # give back the shared prefix while it waits
                request.num_computed_tokens = 0
                break  # new work never evicts running work
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            encoder.charge(request, request.num_computed_tokens, n)
            chunks.append(ScheduledChunk(request, request.num_computed_tokens, n))
            budget -= n
            long_in_flight |= need > self.config.max_num_batched_tokens

    def _adapter_resident(
        self, request: Request, failed: list[tuple[Request, AdapterLoadError]]
    ) -> bool:
        """Whether ``request``'s adapter (if any) is resident now, loading it if a slot is
        free or held by an adapter no running request uses; a load failure goes to
        ``failed``."""
        key = request.params.lora
        if key is None:
            return True
        in_use = {r.params.lora for r in self.running if r.params.lora is not None}
        try:
            return self.adapters.admit(key, in_use)
        except AdapterLoadError as exc:
            failed.append((request, exc))
            return False

    def _schedule_running(
        self,
        requests: list[Request],
        budget: int,
        chunks: list[ScheduledChunk],
        preempted: list[str],
        encoder: EncoderBudget,
        drafts: dict[str, tuple[int, ...]] | None = None,
    ) -> int:
        """Chunks for ``requests`` (running ones) within ``budget``; returns what is left.
        ``drafts``: speculated tokens of decodes, by request id."""
        for request in requests:
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            n = _whole_spans(request, min(_remaining(request), budget))
            fit = encoder.fit(request, request.num_computed_tokens, n)
            if fit < n:
                encoder.close()  # its media go first in the next step
                n = fit
            if n == 0:
                continue  # waiting for its sampled token to be appended, or for the encoder
            draft = drafts.get(request.request_id, ()) if drafts else ()
            draft = draft[: budget - n]
            if draft and not self.kv.allocate_slots(request, n + len(draft)):
                draft = ()  # no room for them: a plain decode
            if not self._make_room(request, n + len(draft), preempted):
                continue
            encoder.charge(request, request.num_computed_tokens, n)
            n += len(draft)
            chunks.append(ScheduledChunk(request, request.num_computed_tokens, n, draft))
            budget -= n
        return budget

    def _is_encoded(self, digest: str) -> bool:
        return self.encoder_cache is not None and digest in self.encoder_cache

    def _drafts(self, decodes: list[Request], prompts_pending: bool) -> dict[str, tuple[int, ...]]:
        """The drafts of this step's decodes: none when speculation is off or the batch is
        large enough to be compute-bound."""
        if self.speculator is None:
            return {}
        k = self.speculator.draft_budget(len(decodes), prompts_pending)
        if k == 0:
            return {}
        proposed = {r.request_id: self.speculator.propose(r, k) for r in decodes}
        return {rid: draft for rid, draft in proposed.items() if draft}

    def _short_waiting_tokens(self) -> int:
        """Tokens the waiting requests that fit one step would take, for the free seats."""
        seats = self.config.max_num_seqs - len(self.running)
        limit = self.config.max_num_batched_tokens
        short = [_remaining(r) for r in self.waiting if _remaining(r) <= limit]
        return sum(short[: max(seats, 0)])

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
            request = chunk.request
            if self.config.no_kv_cache and chunk.completes:
                self.kv.free(request)  # its next token recomputes the whole sequence
                request.num_computed_tokens = 0
                continue
            # Drafts count as computed only once accepted (``settle``).
            request.num_computed_tokens = chunk.start + chunk.num_tokens - len(chunk.draft)
            self.kv.cache_full_blocks(request)

    def settle(self, request: Request, accepted: int) -> None:
        """After a verified chunk's tokens were appended: its ``accepted`` drafts' KV stands
        (their positions hold the emitted tokens); blocks wholly past the request's tokens,
        written for rejected drafts, go back to the pool."""
        if request.status is not RequestStatus.RUNNING:
            return  # it finished: its blocks are gone already
        request.num_computed_tokens += accepted
        self.kv.truncate(request, request.num_tokens)
        self.kv.cache_full_blocks(request)


def _whole_spans(request: Request, n: int) -> int:
    """``n`` tokens from where the request stands, moved so the chunk does not end inside one
    of its bidirectional spans (module doc)."""
    start = request.num_computed_tokens
    end = start + n
    for a, b in request.bidirectional_spans:
        if a < end < b:
            return a - start if a > start else b - start
    return n


def _remaining(request: Request) -> int:
    """Tokens of the request not computed yet (1 for a decode)."""
    return request.num_tokens - request.num_computed_tokens
