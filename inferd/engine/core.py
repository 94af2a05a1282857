"""EngineCore: one synchronous step = schedule, run the model, sample, update requests.

Prompt logprobs (``SamplingParams.prompt_logprobs``) are gathered across the prefill chunks of
a request, indexed by prompt position (a preempted request recomputes and overwrites them), and
handed out once, on the request's first output.

A chunk with speculative drafts (engine/speculative.py) has logits at each of its rows: the
speculator judges the drafts against them, and the accepted drafts plus one token of the model's
own are appended one by one, with the same stop, EOS and max_tokens checks as any token (a
token that ends the request drops the ones after it); its output carries them all.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from inferd.engine.lora_slots import AdapterLoadError
from inferd.engine.outputs import RequestOutput, TokenLogprob
from inferd.engine.request import Request, RequestStatus
from inferd.engine.runner import ModelRunner, PromptLogits, StepResult
from inferd.engine.sampler import prompt_token_logprobs, sample
from inferd.engine.scheduler import ScheduledChunk, Scheduler
from inferd.kernels.ops import KernelOps
from inferd.structured.masks import MaskJob


class EngineCore:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, max_model_len: int) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.steps = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.last_step_seconds = 0.0
        # request id -> one slot per prompt token, filled as prefill chunks are computed
        self.prompt_logprobs: dict[str, list[TokenLogprob | None]] = {}

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def _ops(self) -> KernelOps:
        """The model's kernel ops (the sampler's argmax), read each step: a caller may switch
        them between steps (``use_kernels``)."""
        return self.runner.model.ops

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        self.requests[request.request_id] = request
        self.prompt_tokens += request.num_prompt_tokens
        if request.params.prompt_logprobs is not None:
            self.prompt_logprobs[request.request_id] = [None] * request.num_prompt_tokens
        self.scheduler.add(request)

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.prompt_logprobs.pop(request_id, None)
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        return _output(request, "", (), "abort")

    def fail_all(self, message: str) -> list[RequestOutput]:
        """After an unrecoverable step error: end every request with an error output."""
        outputs = []
        for request in list(self.requests.values()):
            self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
            outputs.append(_output(request, "", (), "error", error=message))
        self.requests.clear()
        self.prompt_logprobs.clear()
        return outputs

    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        failed = [self._fail(request, exc) for request, exc in scheduled.failed]
        if not scheduled.chunks:
            return failed
        started = time.perf_counter()
        # Constrained rows: their masks are computed while the model runs (structured/masks.py),
        # a draft's row with the matcher advanced over the drafts before it.
        samplers = [(c.request.matcher, c.draft) for c in scheduled.chunks if c.completes]
        masks = MaskJob.start(samplers, self.runner.config.vocab_size)
        result = self.runner.execute(scheduled)
        self.scheduler.advance(scheduled)
        self._gather_prompt_logprobs(result.prompt_logits)
        masks.apply(result.logits)
        if any(c.draft for c in result.chunks):
            outputs = self._sample_with_drafts(result)
        else:
            sampled = sample(result.logits, [c.request for c in result.chunks], self._ops)
            outputs = [
                self._append(c.request, t, lp)
                for c, t, lp in zip(result.chunks, sampled.token_ids, sampled.logprobs, strict=True)
            ]
        if result.hidden is not None:
            _keep_hidden(result, outputs)
        self.steps += 1
        self.last_step_seconds = time.perf_counter() - started
        return failed + outputs

    def _fail(self, request: Request, exc: AdapterLoadError) -> RequestOutput:
        """End a request that cannot run (its adapter failed to load) with an error output
        whose ``error_code`` says why, so the server answers it as the client's (or the
        operator's) problem, not the engine's."""
        self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
        self.requests.pop(request.request_id, None)
        self.prompt_logprobs.pop(request.request_id, None)
        return replace(_output(request, "", (), "error", error=str(exc)), error_code=exc.code)

    def _sample_with_drafts(self, result: StepResult) -> list[RequestOutput]:
        """The plain rows sampled as one batch, each chunk with drafts verified on its rows."""
        firsts, row = [], 0
        for chunk in result.chunks:
            firsts.append(row)
            row += 1 + len(chunk.draft)
        plain = [(c, r) for c, r in zip(result.chunks, firsts, strict=True) if not c.draft]
        index = torch.tensor([r for _, r in plain], dtype=torch.long)
        requests = [c.request for c, _ in plain]
        sampled = sample(result.logits.index_select(0, index), requests, self._ops)
        drawn = iter(zip(sampled.token_ids, sampled.logprobs, strict=True))
        outputs = []
        for chunk, first in zip(result.chunks, firsts, strict=True):
            if chunk.draft:
                rows = result.logits[first : first + 1 + len(chunk.draft)]
                outputs.append(self._append_verified(chunk, rows))
            else:
                token, logprob = next(drawn)
                outputs.append(self._append(chunk.request, token, logprob))
        return outputs

    def _append_verified(self, chunk: ScheduledChunk, logits: torch.Tensor) -> RequestOutput:
        """Judge the chunk's drafts on its rows' logits and append what they give."""
        speculator = self.scheduler.speculator
        assert speculator is not None  # only its proposals carry drafts
        request = chunk.request
        verdict = speculator.verify(logits, chunk.draft, request)
        k = request.params.logprobs
        logprobs = (
            prompt_token_logprobs(logits[: len(verdict.tokens)], verdict.tokens, k)
            if k is not None
            else [None] * len(verdict.tokens)
        )
        parts = []
        for token, logprob in zip(verdict.tokens, logprobs, strict=True):
            parts.append(self._append(request, token, logprob))
            if parts[-1].finished:
                break
        self.scheduler.settle(request, verdict.accepted)
        return _merge(parts)

    def _gather_prompt_logprobs(self, parts: tuple[PromptLogits, ...]) -> None:
        for part in parts:
            slots = self.prompt_logprobs.get(part.request.request_id)
            if slots is None:
                continue
            request, first = part.request, part.first
            targets = request.prompt_token_ids[first : first + part.logits.shape[0]]
            k = request.params.prompt_logprobs or 0
            slots[first : first + len(targets)] = prompt_token_logprobs(part.logits, targets, k)

    def _append(
        self, request: Request, token: int, logprob: TokenLogprob | None = None
    ) -> RequestOutput:
        request.output_token_ids.append(token)
        self.generated_tokens += 1
        step = request.detokenizer.push(token)
        text = step.text
        if request.thinking is not None:
            request.thinking.feed(text)
        reason: str | None = None
        error = _advance_matcher(request, token)
        if error is not None:
            self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
            del self.requests[request.request_id]
            self.prompt_logprobs.pop(request.request_id, None)
            return _output(request, text, (token,), "error", error=error)
        if step.stop_string is not None:
            reason, request.stop_reason = "stop", step.stop_string
        elif (
            not request.params.ignore_eos and token in request.eos_token_ids
        ) or token in request.params.stop_token_ids:
            reason, request.stop_reason = "stop", token
        elif request.matcher is not None and request.matcher.done:
            reason = "stop"  # the constraint is complete: only an end-of-turn token could follow
        elif (
            len(request.output_token_ids) >= request.params.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            reason = "length"
        if reason is not None:
            if step.stop_string is None:
                text += request.detokenizer.flush()
            status = (
                RequestStatus.FINISHED_STOPPED
                if reason == "stop"
                else RequestStatus.FINISHED_LENGTH
            )
            self.scheduler.finish(request, status)
            del self.requests[request.request_id]
        logprobs = (logprob,) if logprob is not None else None
        prompt = self.prompt_logprobs.pop(request.request_id, None)
        out = _output(request, text, (token,), reason, logprobs=logprobs)
        return out if prompt is None else replace(out, prompt_logprobs=tuple(prompt))


def _keep_hidden(result: StepResult, outputs: list[RequestOutput]) -> None:
    """Each chunk's hidden state at the row whose logits gave its last appended token, for a
    drafter that starts from it (engine/draft_model.py's AssistantDrafter)."""
    assert result.hidden is not None
    first = 0
    for chunk, out in zip(result.chunks, outputs, strict=True):
        if out.token_ids:
            chunk.request.draft_hidden = result.hidden[first + len(out.token_ids) - 1].clone()
        first += 1 + len(chunk.draft)


def _merge(parts: list[RequestOutput]) -> RequestOutput:
    """One output for the tokens a step appended to one request, in order."""
    if len(parts) == 1:
        return parts[0]
    last = parts[-1]
    logprobs = [lp for p in parts for lp in p.logprobs or ()]
    return replace(
        last,
        text="".join(p.text for p in parts),
        token_ids=tuple(t for p in parts for t in p.token_ids),
        logprobs=tuple(logprobs) if last.logprobs is not None else None,
        prompt_logprobs=parts[0].prompt_logprobs,
    )


def _advance_matcher(request: Request, token: int) -> str | None:
    """Feed a sampled token to the request's matcher; an error message if it is refused
    (never expected: the token was sampled under the matcher's own mask)."""
    if request.matcher is None or request.matcher.consume(token):
        return None
    return f"the output constraint refused token {token}: {request.matcher.error}"


def _output(
    request: Request,
    text: str,
    tokens: tuple[int, ...],
    reason: str | None,
    error: str | None = None,
    logprobs: tuple[TokenLogprob, ...] | None = None,
) -> RequestOutput:
    return RequestOutput(
        request_id=request.request_id,
        text=text,
        token_ids=tokens,
        finish_reason=reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=len(request.output_token_ids),
        stop_reason=request.stop_reason,
        error=error,
        logprobs=logprobs,
        reasoning_tokens=request.thinking.reasoning_tokens if request.thinking else 0,
    )
