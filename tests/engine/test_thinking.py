"""engine/thinking.py: which output tokens are reasoning, and where a budget forces the close."""

from __future__ import annotations

import pytest

from inferd.engine.thinking import ThinkingSpec, ThinkingTracker

CLOSE_IDS = (90, 91)  # the closing marker's tokens, as a tokenizer would give them


def _run(tracker: ThinkingTracker, pieces: list[str]) -> list[int | None]:
    """Feed the pieces (one per token); what was forced before each token."""
    forced = []
    for piece in pieces:
        forced.append(tracker.forced_token())
        tracker.feed(piece)
    return forced


def test_counts_the_block_markers_included() -> None:
    tracker = ThinkingTracker(ThinkingSpec("<think>", "</think>", CLOSE_IDS))
    _run(tracker, ["\n", "<th", "ink>", "a", "b", "</", "think>", "answer", "more"])
    assert tracker.reasoning_tokens == 7  # through the token that completed the marker


def test_no_block_counts_nothing() -> None:
    tracker = ThinkingTracker(ThinkingSpec("<think>", "</think>", CLOSE_IDS))
    _run(tracker, [" ", "Hello", "<think>", "x"])
    assert tracker.reasoning_tokens == 0


def test_opened_by_the_prompt_and_never_closed() -> None:
    spec = ThinkingSpec("<think>", "</think>", CLOSE_IDS, started_in_reasoning=True)
    tracker = ThinkingTracker(spec)
    _run(tracker, ["a", "b", "c"])
    assert tracker.reasoning_tokens == 3


def test_budget_forces_the_closing_tokens_then_lets_go() -> None:
    spec = ThinkingSpec("<think>", "</think>", CLOSE_IDS, started_in_reasoning=True, budget=3)
    tracker = ThinkingTracker(spec)
    forced = _run(tracker, ["a", "b", "c", "</", "think>", "answer", "more"])
    assert forced == [None, None, None, 90, 91, None, None]
    assert tracker.reasoning_tokens == 5 and tracker.budget_spent


def test_a_block_closed_within_budget_is_not_touched() -> None:
    spec = ThinkingSpec("<think>", "</think>", CLOSE_IDS, budget=10)
    tracker = ThinkingTracker(spec)
    forced = _run(tracker, ["<think>", "a", "</think>", *["x"] * 12])
    assert forced == [None] * 15 and not tracker.budget_spent


def test_bad_specs() -> None:
    with pytest.raises(ValueError):
        ThinkingSpec("", "</think>", CLOSE_IDS)
    with pytest.raises(ValueError):
        ThinkingSpec("<think>", "</think>", (), budget=4)
    with pytest.raises(ValueError):
        ThinkingSpec("<think>", "</think>", CLOSE_IDS, budget=0)
