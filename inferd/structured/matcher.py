"""One request's progress through its constraint: which tokens may come next, and the tokens
it has taken. The engine consumes each sampled token exactly once, when it is appended to the
request's output, so a preempted request that recomputes its KV cache keeps its matcher as is
(recompute re-runs the model over tokens already consumed; it samples only the next one)."""

from __future__ import annotations

from dataclasses import dataclass

import llguidance


@dataclass(slots=True)
class TokenMatcher:
    inner: llguidance.LLMatcher

    def consume(self, token: int) -> bool:
        """Advance past a sampled token; False if the constraint does not allow it."""
        return self.inner.consume_token(token)

    @property
    def done(self) -> bool:
        """Nothing but an end-of-turn token may follow: the output is complete."""
        return self.inner.is_stopped()

    @property
    def accepting(self) -> bool:
        """The output so far satisfies the constraint (it could end here)."""
        return self.inner.is_accepting()

    @property
    def error(self) -> str | None:
        return self.inner.get_error() or None if self.inner.is_error() else None
