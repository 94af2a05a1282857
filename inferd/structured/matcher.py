"""One request's progress through its constraint: which tokens may come next, and the tokens
it has taken. The engine consumes each sampled token exactly once, when it is appended to the
request's output, so a preempted request that recomputes its KV cache keeps its matcher as is
(recompute re-runs the model over tokens already consumed; it samples only the next one)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import llguidance
import torch

# A row's mask: a grammar matcher's next tokens, and the tokens allowed beside them (None: only
# the grammar's)
MaskSource = tuple[llguidance.LLMatcher, torch.Tensor | None]
_BITS = torch.arange(32, dtype=torch.int32)


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

    def mask_source(self) -> MaskSource | None:
        """What this step's mask comes from: a grammar matcher, and the tokens allowed beside
        its own (None: only its own); None when the next token is free."""
        return None if self.inner is None else (self.inner, None)

    def row_sources(self, draft: Sequence[int]) -> list[MaskSource | None] | None:
        """The mask sources of a chunk's rows (its own, then one after each of ``draft``) when
        each is worked out alone; None: the grammar matcher advanced over the drafts gives them
        (structured/masks.py does that in one llguidance call and rolls it back)."""
        return None

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens``, in order, the constraint would take from here (it takes
        none of them: the matcher does not move)."""
        return len(tokens) if self.inner is None else self.inner.validate_tokens(tokens)

    def draft_guide(self) -> DraftGuide | None:
        """A copy of this matcher's state a draft model steps through as it drafts, to draft
        only what the constraint takes (engine/draft_model.py); None: every token is."""
        return None if self.inner is None else GrammarGuide(self.inner.deep_copy())


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
        tail = self.tail + self.tokenizer.decode_bytes([token])
        found = _trigger_at(self.tables, tail)
        if found is None:
            self.tail = _keep(self.tables, tail)
            return True
        self.inner, self.waiting = self.waiting, None
        ids = self.tokenizer.tokenize_bytes(tail[found:])
        return self.inner.consume_tokens(ids)

    def valid_prefix(self, tokens: list[int]) -> int:
        """While waiting: the tokens before the first that would complete a trigger. A draft
        stops short of a trigger, so the rows after its tokens are still free text, each
        masked (``row_sources``) as the step that had appended them one by one would be."""
        if self.inner is not None:
            return self.inner.validate_tokens(tokens)
        assert self.tokenizer is not None
        tail = self.tail
        for i, token in enumerate(tokens):
            tail += self.tokenizer.decode_bytes([token])
            if _trigger_at(self.tables, tail) is not None:
                return i
            tail = _keep(self.tables, tail)
        return len(tokens)

    def row_sources(self, draft: Sequence[int]) -> list[MaskSource | None] | None:
        """While waiting: row ``i``'s mask is the waiting mask at the output's end after the
        drafts before it (which complete no trigger: ``valid_prefix`` cut them before one)."""
        if self.inner is not None:
            return None
        assert self.tokenizer is not None
        tail, sources = self.tail, []
        for token in [*draft, None]:
            sources.append(self._waiting_source(tail))
            if token is not None:
                tail = _keep(self.tables, tail + self.tokenizer.decode_bytes([token]))
        return sources

    def mask_source(self) -> MaskSource | None:
        if self.inner is not None:
            return self.inner, None
        return self._waiting_source(self.tail)

    def _waiting_source(self, tail: bytes) -> MaskSource | None:
        """While waiting, the next token is free unless it would complete a trigger: then the
        bytes from the trigger on must start a valid call (a token such as ``>"`` after
        ``<tool_call`` would open a call the grammar refuses). So a token that completes a
        trigger is allowed only where the grammar, fed the trigger's start, allows it. The
        grammar is fed the longest start the output ends with; the triggers of one syntax begin
        alike (``[name(`` for each tool), so their started parts are the same bytes."""
        assert self.waiting is not None and self.tokenizer is not None
        live: list[tuple[int, TriggerTable, torch.Tensor]] = []
        for table in self.tables:
            start = table.partial(tail)
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

    def draft_guide(self) -> DraftGuide | None:
        if self.inner is not None:
            return GrammarGuide(self.inner.deep_copy())
        assert self.tokenizer is not None
        return WaitingGuide(self.tables, self.tokenizer, self.tail)


def _trigger_at(tables: Sequence[TriggerTable], tail: bytes) -> int | None:
    """Where the earliest trigger found in ``tail`` begins (None: none is)."""
    found = [at for at in (tail.find(t.trigger) for t in tables) if at >= 0]
    return min(found) if found else None


def _keep(tables: Sequence[TriggerTable], tail: bytes) -> bytes:
    """The last bytes of the output that could still hold the start of a trigger."""
    keep = max(len(t.trigger) for t in tables) - 1
    return tail[-keep:] if keep > 0 else b""


class DraftGuide(Protocol):
    """A constraint's state stepped through by a draft model as it drafts."""

    def allowed(self, vocab_size: int) -> torch.Tensor | None:
        """The tokens [vocab_size] the next draft may be (bool); None: any."""
        ...

    def take(self, token: int) -> None:
        """The next draft is ``token`` (one ``allowed`` gave)."""
        ...


@dataclass(slots=True)
class GrammarGuide:
    """A grammar matcher's copy: the drafts follow its masks."""

    matcher: llguidance.LLMatcher

    def allowed(self, vocab_size: int) -> torch.Tensor | None:
        if self.matcher.is_stopped() or self.matcher.is_error():
            return torch.zeros(vocab_size, dtype=torch.bool)  # nothing to draft after the end
        # The tokenizer's vocabulary may be shorter than the model's (padded) one: no bits there.
        raw = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)
        words = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)
        n = min(len(words), len(raw))
        words[:n] = raw[:n]
        return unpack(words[None], vocab_size)[0]

    def take(self, token: int) -> None:
        self.matcher.consume_token(token)


@dataclass(slots=True)
class WaitingGuide:
    """A lazy matcher waiting for its trigger: drafts never complete one (the speculator cuts
    a draft before such a token), so each may be any token but those."""

    tables: Sequence[TriggerTable]
    tokenizer: llguidance.LLTokenizer
    tail: bytes

    def allowed(self, vocab_size: int) -> torch.Tensor | None:
        refused = [t.completing[t.partial(self.tail)] for t in self.tables]
        masks = [m[:vocab_size] for m in refused if m is not None]
        return None if not masks else ~torch.stack(masks).any(0)

    def take(self, token: int) -> None:
        self.tail = _keep(self.tables, self.tail + self.tokenizer.decode_bytes([token]))


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


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 bitmask -> [rows, vocab_size] bool, True where a token is allowed."""
    bits = (bitmask.unsqueeze(-1) >> _BITS) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
