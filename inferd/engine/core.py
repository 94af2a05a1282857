"""EngineCore: one synchronous step = schedule, run the model, sample, update requests."""

from __future__ import annotations

import time

from inferd.engine.outputs import RequestOutput, TokenLogprob
from inferd.engine.request import Request, RequestStatus
from inferd.engine.runner import ModelRunner
from inferd.engine.sampler import sample
from inferd.engine.scheduler import Scheduler


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

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        self.requests[request.request_id] = request
        self.prompt_tokens += request.num_prompt_tokens
        self.scheduler.add(request)

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        return _output(request, "", (), "abort")

    def fail_all(self, message: str) -> list[RequestOutput]:
        """After an unrecoverable step error: end every request with an error output."""
        outputs = []
        for request in list(self.requests.values()):
            self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
            outputs.append(_output(request, "", (), "error", error=message))
        self.requests.clear()
        return outputs

    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        if scheduled.empty:
            return []
        started = time.perf_counter()
        logits, chunks = self.runner.execute(scheduled)
        self.scheduler.advance(scheduled)
        sampled = sample(logits, [c.request for c in chunks])
        outputs = [
            self._append(c.request, t, lp)
            for c, t, lp in zip(chunks, sampled.token_ids, sampled.logprobs, strict=True)
        ]
        self.steps += 1
        self.last_step_seconds = time.perf_counter() - started
        return outputs

    def _append(
        self, request: Request, token: int, logprob: TokenLogprob | None = None
    ) -> RequestOutput:
        request.output_token_ids.append(token)
        self.generated_tokens += 1
        step = request.detokenizer.push(token)
        text = step.text
        reason: str | None = None
        if step.stop_string is not None:
            reason, request.stop_reason = "stop", step.stop_string
        elif (
            not request.params.ignore_eos and token in request.eos_token_ids
        ) or token in request.params.stop_token_ids:
            reason, request.stop_reason = "stop", token
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
        return _output(request, text, (token,), reason, logprobs=logprobs)


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
    )
