"""One request's progress through its constraint: which tokens may come next, and the tokens
it has taken. The engine consumes each sampled token exactly once, when it is appended to the
request's output, so a preempted request that recomputes its KV cache keeps its matcher as is
(recompute re-runs the model over tokens already consumed; it samples only the next one)."""

from __future__ import annotations

from dataclasses import dataclass, field

import llguidance
import torch


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

    def mask_source(self) -> tuple[llguidance.LLMatcher, torch.Tensor | None] | None:
        """What this step's mask comes from: a grammar matcher, and the tokens allowed beside
        its own (None: only its own); None when the next token is free."""
        return None if self.inner is None else (self.inner, None)

    @property
    def follows_drafts(self) -> bool:
        """Whether speculative drafts can be checked and masked here: the grammar matcher is
        the whole story (structured/masks.py advances it over the drafts and rolls it back)."""
        return True

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens``, in order, the constraint would take from here (it takes
        none of them: the matcher does not move)."""
        return len(tokens) if self.inner is None else self.inner.validate_tokens(tokens)


@dataclass(slots=True)
class LazyMatcher(TokenMatcher):
    """Free output until one of its triggers appears in it; from that trigger's first byte on,
    the output follows ``waiting`` (a grammar that starts with any trigger). The bytes from the
    trigger to the end of the token that completed it are fed to the grammar as tokens of
    their own: llguidance matches bytes, so any split of them into tokens is accepted."""

    waiting: llguidance.LLMatcher | None = None
    tokenizer: llguidance.LLTokenizer | None = None
    tables: tuple[TriggerTable, ...] = ()  # one per trigger: which tokens complete it
    tail: bytes = field(default=b"")  # the output's last bytes, to find a trigger across tokens

    def consume(self, token: int) -> bool:
        if self.inner is not None:
            return self.inner.consume_token(token)
        assert self.waiting is not None and self.tokenizer is not None
        self.tail += self.tokenizer.decode_bytes([token])
        found = [at for at in (self.tail.find(t.trigger) for t in self.tables) if at >= 0]
        if not found:
            keep = max(len(t.trigger) for t in self.tables) - 1
            self.tail = self.tail[-keep:] if keep > 0 else b""
            return True
        self.inner, self.waiting = self.waiting, None
        ids = self.tokenizer.tokenize_bytes(self.tail[min(found) :])
        return self.inner.consume_tokens(ids)

    @property
    def follows_drafts(self) -> bool:
        """Not while waiting: each row after a draft would need the trigger search run over
        the drafts before it."""
        return self.inner is not None

    def mask_source(self) -> tuple[llguidance.LLMatcher, torch.Tensor | None] | None:
        """While waiting, the next token is free unless it would complete a trigger: then the
        bytes from the trigger on must start a valid call (a token such as ``>"`` after
        ``<tool_call`` would open a call the grammar refuses). So a token that completes a
        trigger is allowed only where the grammar, fed the trigger's start, allows it. The
        grammar is fed the longest start the output ends with; the triggers of one syntax begin
        alike (``[name(`` for each tool), so their started parts are the same bytes."""
        if self.inner is not None:
            return self.inner, None
        assert self.waiting is not None and self.tokenizer is not None
        live: list[tuple[int, TriggerTable, torch.Tensor]] = []
        for table in self.tables:
            start = table.partial(self.tail)
            mask = table.completing[start]
            if mask is not None:
                live.append((start, table, mask))
        if not live:
            return None  # no token completes a trigger from here: free
        completing = torch.stack([mask for _, _, mask in live]).any(0)
        start, table, _ = max(live, key=lambda entry: entry[0])
        probe = self.waiting.deep_copy()
        if start:
            probe.consume_tokens(self.tokenizer.tokenize_bytes(table.trigger[:start]))
        return probe, ~completing


@dataclass(frozen=True, slots=True)
class TriggerTable:
    """For each length k of the trigger's start the output ends with (0: none), the tokens
    whose bytes, after those k, contain the whole trigger (None: no such token). Built once
    per vocabulary and trigger."""

    trigger: bytes
    completing: tuple[torch.Tensor | None, ...]

    @classmethod
    def build(
        cls, tokenizer: llguidance.LLTokenizer, trigger: bytes, vocab_size: int
    ) -> TriggerTable:
        sets: list[list[int]] = [[] for _ in trigger]
        last = trigger[-1:]
        for token in range(min(vocab_size, tokenizer.vocab_size)):
            text = tokenizer.decode_bytes([token])
            if last not in text:  # a completed trigger ends inside the token
                continue
            for k in range(len(trigger)):
                if trigger in trigger[:k] + text:
                    sets[k].append(token)
        tables: list[torch.Tensor | None] = []
        for ids in sets:
            if not ids:
                tables.append(None)
                continue
            mask = torch.zeros(vocab_size, dtype=torch.bool)
            mask[ids] = True
            tables.append(mask)
        return cls(trigger, tuple(tables))

    def partial(self, tail: bytes) -> int:
        """Length of the longest start of the trigger that ``tail`` ends with."""
        for k in range(min(len(self.trigger) - 1, len(tail)), 0, -1):
            if tail.endswith(self.trigger[:k]):
                return k
        return 0
