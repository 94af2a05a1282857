"""One request's progress through its constraint: which tokens may come next, and the tokens
it has taken. The engine consumes each sampled token exactly once, when it is appended to the
request's output, so a preempted request that recomputes its KV cache keeps its matcher as is
(recompute re-runs the model over tokens already consumed; it samples only the next one)."""

from __future__ import annotations

from dataclasses import dataclass, field

import llguidance


@dataclass(slots=True)
class TokenMatcher:
    inner: llguidance.LLMatcher | None  # None while a lazy matcher waits for its trigger

    def consume(self, token: int) -> bool:
        """Advance past a sampled token; False if the constraint does not allow it."""
        return self.inner is None or self.inner.consume_token(token)

    @property
    def done(self) -> bool:
        """Nothing but an end-of-turn token may follow: the output is complete."""
        return self.inner is not None and self.inner.is_stopped()

    @property
    def accepting(self) -> bool:
        """The output so far satisfies the constraint (it could end here)."""
        return self.inner is None or self.inner.is_accepting()

    @property
    def error(self) -> str | None:
        if self.inner is None or not self.inner.is_error():
            return None
        return self.inner.get_error() or "constraint error"


@dataclass(slots=True)
class LazyMatcher(TokenMatcher):
    """Free output until one of ``triggers`` appears in it; from that trigger's first byte on,
    the output follows ``waiting`` (a grammar that starts with any trigger). The bytes from the
    trigger to the end of the token that completed it are fed to the grammar as tokens of
    their own: llguidance matches bytes, so any split of them into tokens is accepted."""

    waiting: llguidance.LLMatcher | None = None
    triggers: tuple[bytes, ...] = ()
    tokenizer: llguidance.LLTokenizer | None = None
    tail: bytes = field(default=b"")  # the output's last bytes, to find a trigger across tokens

    def consume(self, token: int) -> bool:
        if self.inner is not None:
            return self.inner.consume_token(token)
        assert self.waiting is not None and self.tokenizer is not None
        self.tail += self.tokenizer.decode_bytes([token])
        found = [at for at in (self.tail.find(t) for t in self.triggers) if at >= 0]
        if not found:
            keep = max(len(t) for t in self.triggers) - 1
            self.tail = self.tail[-keep:] if keep > 0 else b""
            return True
        self.inner, self.waiting = self.waiting, None
        ids = self.tokenizer.tokenize_bytes(self.tail[min(found) :])
        return self.inner.consume_tokens(ids)
