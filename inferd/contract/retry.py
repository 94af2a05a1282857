"""When a length-limited answer may be asked again, and how: the retry policy of seed 000's
exercise 2.

An ``IncompleteLengthLimited`` outcome is never a success, and the client does not quietly
paper over it. A retry is a new run (a new request id, its own receipts) of the same model and
input with one budget changed, ``max_tokens``, and only when the product says it may pay for
more: ``LengthRetryPolicy.allowed`` is off unless set, and ``ceiling`` bounds what it pays.
``retry_length_limited`` checks that each rebuilt request differs from the first in nothing
but its id and that budget, so a retry can never drift to another model or another input.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inferd.contract.request import ChatRequest
from inferd.contract.stream import IncompleteLengthLimited, Outcome


class RetryError(ValueError):
    """A policy that cannot hold, or a rebuilt request that is not the same run's input."""


@dataclass(frozen=True)
class LengthRetryPolicy:
    """Whether and how far a length-limited run may be run again with a larger budget."""

    allowed: bool = False  # the product permits spending more output tokens on this input
    ceiling: int = 0  # the most output tokens it pays for in one run
    growth: float = 2.0  # each run's budget over the last's
    max_runs: int = 3  # runs in all, the first included

    def __post_init__(self) -> None:
        if self.allowed and self.ceiling < 1:
            raise RetryError("a policy that allows retries needs a ceiling of at least 1 token")
        if self.growth <= 1.0:
            raise RetryError(f"growth must be over 1 (got {self.growth}): a retry must add budget")
        if self.max_runs < 1:
            raise RetryError(f"max_runs must be at least 1 (got {self.max_runs})")

    def next_budget(self, outcome: Outcome, budget: int, runs: int) -> int | None:
        """The budget of the next run after ``outcome`` (run number ``runs``, at ``budget``),
        or None: not length-limited, not allowed, out of runs, or already at the ceiling."""
        if not isinstance(outcome, IncompleteLengthLimited) or not self.allowed:
            return None
        if runs >= self.max_runs or budget >= self.ceiling:
            return None
        return min(self.ceiling, max(budget + 1, int(budget * self.growth)))


@dataclass(frozen=True)
class Run:
    request_id: str
    max_tokens: int
    outcome: Outcome


@dataclass(frozen=True)
class RetriedRun:
    """Every run made, in order; ``outcome`` is the last one's (length-limited still, when
    the policy stopped at its ceiling: never turned into a success)."""

    runs: tuple[Run, ...]

    @property
    def outcome(self) -> Outcome:
        return self.runs[-1].outcome


def retry_length_limited(
    build: Callable[[str, int], ChatRequest],
    send: Callable[[ChatRequest], Outcome],
    *,
    request_id: str,
    max_tokens: int,
    policy: LengthRetryPolicy,
) -> RetriedRun:
    """Run ``build(request_id, max_tokens)`` through ``send``; while the policy allows, run it
    again as ``build(f"{request_id}-r{n}", larger budget)``. RetryError when a rebuilt
    request's body differs from the first in anything but ``max_tokens``."""
    first = build(request_id, max_tokens)
    identity = _identity(first)
    runs = [Run(first.request_id, max_tokens, send(first))]
    while budget := policy.next_budget(runs[-1].outcome, runs[-1].max_tokens, len(runs)):
        request = build(f"{request_id}-r{len(runs)}", budget)
        if request.request_id in {r.request_id for r in runs}:
            raise RetryError(f"a retry must be a new run: {request.request_id!r} was sent")
        if _identity(request) != identity or request.max_tokens != budget:
            raise RetryError("a retry changed more than max_tokens: not the same model and input")
        runs.append(Run(request.request_id, budget, send(request)))
    return RetriedRun(tuple(runs))


def _identity(request: ChatRequest) -> tuple[Any, ...]:
    """What must not change between runs: the route, the endpoint, the media digests and the
    body but for its token budget."""
    body = json.loads(request.body)
    body.pop("max_tokens", None)
    body.pop("max_completion_tokens", None)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return (
        request.model_route,
        request.endpoint,
        request.tenant,
        request.artifact_digests,
        canonical,
    )
