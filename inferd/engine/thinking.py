"""A reasoning model's think block, followed token by token inside the engine.

The server decides how a reply splits (server/reasoning.py); the engine only needs to know
two things per request, which it can learn nowhere else without decoding the output again:
how many output tokens the reasoning took (``usage``'s ``reasoning_tokens``), and when a
thinking budget is spent, so that it can close the block itself (Anthropic's
``thinking.budget_tokens``). At the budget the sampler's choice is replaced by the closing
marker's tokens, one per step, after which the model goes on to its answer.

The block is recognized as the server's splitter does: opened by the prompt, or by the output's
first non-blank text; closed by the first closing marker after it. Text is matched, not token
ids, so a marker the model spells in other tokens than ``close_ids`` still counts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ThinkingSpec:
    """How a request's reply may reason: the markers, whether the prompt opened the block,
    the closing marker's token ids (forced at the budget), and the budget (None: none)."""

    open: str
    close: str
    close_ids: tuple[int, ...]
    started_in_reasoning: bool = False
    budget: int | None = None  # most reasoning tokens before the block is closed for the model

    def __post_init__(self) -> None:
        if not self.open or not self.close:
            raise ValueError("thinking markers must not be empty")
        if self.budget is not None and (self.budget < 1 or not self.close_ids):
            raise ValueError("a thinking budget needs a positive size and the closing tokens")


class _Phase(enum.Enum):
    START = 1  # the output may still open a block (only blanks so far)
    REASONING = 2
    CLOSING = 3  # the budget is spent: the closing tokens are being forced
    DONE = 4  # the block closed, or never opened


@dataclass(slots=True)
class ThinkingTracker:
    spec: ThinkingSpec
    reasoning_tokens: int = 0  # output tokens up to and including the one closing the block
    _phase: _Phase = _Phase.START
    _text: str = ""  # the output's text so far while it matters (START, REASONING)
    _forced: int = 0  # closing tokens forced so far

    def __post_init__(self) -> None:
        if self.spec.started_in_reasoning:
            self._phase = _Phase.REASONING

    @property
    def budget_spent(self) -> bool:
        return self._phase is _Phase.CLOSING or (
            self._phase is _Phase.DONE and self._forced == len(self.spec.close_ids) > 0
        )

    def forced_token(self) -> int | None:
        """The token the next step must emit (a closing token past the budget), or None."""
        if self._phase is _Phase.CLOSING:
            return self.spec.close_ids[self._forced]
        return None

    def unforced_ahead(self) -> int | None:
        """The most tokens that may be drafted now with no row of their verification forced:
        the next token's and one after each draft (engine/speculative.py). None: no limit (no
        budget, or the block is over). Each token fed before the close counts toward the budget,
        whatever its text, and the budget forces once the count reaches it; so ``m`` drafts
        are safe while ``reasoning_tokens + m`` stays below it (a marker the drafts close the
        block with ends it sooner, which only frees rows)."""
        if self._phase is _Phase.CLOSING:
            return 0
        if self._phase is _Phase.DONE or self.spec.budget is None:
            return None
        return max(0, self.spec.budget - self.reasoning_tokens - 1)

    def feed(self, text: str) -> None:
        """One output token was appended; ``text`` is what it released (may be empty)."""
        if self._phase is _Phase.DONE:
            return
        if self._phase is _Phase.CLOSING:
            self.reasoning_tokens += 1
            self._forced += 1
            if self._forced == len(self.spec.close_ids):
                self._phase = _Phase.DONE
            return
        self._text += text
        self.reasoning_tokens += 1
        if self._phase is _Phase.START:
            self._start()
        if self._phase is _Phase.REASONING:
            self._reasoning()

    def _start(self) -> None:
        stripped = self._text.lstrip()
        opener = self.spec.open
        if len(stripped) < len(opener) and opener.startswith(stripped):
            return  # blanks, or the marker's beginning: undecided
        if stripped.startswith(opener):
            self._phase = _Phase.REASONING
            self._text = stripped[len(opener) :]
        else:
            self._phase, self.reasoning_tokens = _Phase.DONE, 0  # no block: an answer

    def _reasoning(self) -> None:
        if self.spec.close in self._text:
            self._phase, self._text = _Phase.DONE, ""
            return
        # keep only what could still hold the closing marker's start
        self._text = self._text[-len(self.spec.close) :]
        if self.spec.budget is not None and self.reasoning_tokens >= self.spec.budget:
            self._phase = _Phase.CLOSING
