"""Limits the public APIs set on a request, checked here before the engine sees it.

OpenAI documents at most 4 stop sequences and 20 top logprobs (Anthropic's Messages API takes
stop sequences too, and this server holds them to the same 4); ``n`` and the choices of one
request are this server's own bounds on the work a request may ask for. The engine's
``SamplingParams`` keeps only what its own code needs (non-empty stop strings, non-negative
counts), so Python callers of the engine are not held to an HTTP API's limits.

The (token, logprob) pairs one response may carry are bounded by ``--max-logprobs-tokens``, for
chat's ``logprobs``/``top_logprobs`` as for completions' ``logprobs``/``echo``: a request that
could exceed it is a 400, and one without ``max_tokens`` gets a default that stays within it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from inferd.server.errors import bad_request
from inferd.serving.interface import SamplingParamError

MAX_N = 16  # choices per prompt
MAX_CHOICES = 64  # choices per request, over all prompts
MAX_STOP_SEQUENCES = 4
MAX_TOP_LOGPROBS = 20


def check_n(n: int | None, num_prompts: int = 1) -> int:
    """The number of choices per prompt (1 when not given); 400 beyond the limits."""
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise bad_request(f"n must be between 1 and {MAX_N}, got {n}", "n")
    if n * num_prompts > MAX_CHOICES:
        raise bad_request(
            f"{num_prompts} prompts x n={n} asks for {n * num_prompts} choices; "
            f"at most {MAX_CHOICES} per request",
            "n",
        )
    return n


def check_sampling_limits(stop: Sequence[str], logprobs: int | None = None) -> None:
    """SamplingParamError naming the SamplingParams field over an API limit; the routes
    translate it as they do the engine's own (into their field names and envelopes)."""
    if len(stop) > MAX_STOP_SEQUENCES:
        raise SamplingParamError(
            "stop", f"at most {MAX_STOP_SEQUENCES} stop strings, got {len(stop)}"
        )
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise SamplingParamError(
            "logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}, got {logprobs}"
        )


@dataclass(frozen=True, slots=True)
class LogprobsAsk:
    """What a request's logprobs could add up to: ``n`` choices of ``tokens`` scored tokens,
    each with ``k`` alternatives; ``k_param`` names k's field, ``advice`` how to ask less."""

    n: int
    k: int
    k_param: str
    advice: str

    def pairs(self, tokens: int) -> int:
        return self.n * tokens * (1 + self.k)

    def most_tokens(self, limit: int) -> int:
        """The most scored tokens per choice within ``limit`` pairs."""
        return limit // (self.n * (1 + self.k))


def check_logprobs_size(limit: int, ask: LogprobsAsk, tokens: int, what: str) -> None:
    """400 when the logprobs a request asks for could exceed ``limit`` (token, logprob) pairs
    (--max-logprobs-tokens); ``tokens``: the scored tokens of one choice, ``what`` they are."""
    pairs = ask.pairs(tokens)
    if pairs > limit:
        raise bad_request(
            f"this request could return {pairs} (token, logprob) pairs: n={ask.n} x {tokens} "
            f"{what} x (1 + {ask.k_param}={ask.k}); this server allows at most {limit} per "
            f"response (--max-logprobs-tokens); {ask.advice}",
            ask.k_param,
        )
