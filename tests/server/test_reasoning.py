"""The reasoning splitter: every way of cutting the text into chunks gives the same split."""

from __future__ import annotations

import itertools

import pytest

from inferd.server.reasoning import (
    NONE,
    THINK,
    THINK_MARKERS,
    ReasoningSplitter,
    markers_for,
    opened_in_prompt,
    split,
)

CASES = [
    # (raw output, opened in prompt, reasoning, content)
    ("<think>plan it</think>the answer", False, "plan it", "the answer"),
    ("\n<think>\nr</think>\n\nc", False, "\n\nr", "\n\nc"),
    ("plan it</think>the answer", True, "plan it", "the answer"),
    ("never closes </thin", True, "never closes </thin", ""),
    ("<think>open only", False, "open only", ""),
    ("no thinking <think>x</think>", False, "", "no thinking <think>x</think>"),
    ("<thin", False, "", "<thin"),
    ("<think></think></think>", False, "", "</think>"),
    ("a</th</think>b<think>", True, "a</th", "b<think>"),
]


def _chunked(text: str, cuts: tuple[int, ...], started: bool) -> tuple[str, str, list[bool]]:
    splitter = ReasoningSplitter(THINK_MARKERS, started)
    bounds = [0, *cuts, len(text)]
    reasoning = content = ""
    order: list[bool] = []  # True for each reasoning piece, False for content, as emitted
    for a, b in itertools.pairwise(bounds):
        r, c = splitter.feed(text[a:b])
        reasoning, content = reasoning + r, content + c
        order += [True] * bool(r) + [False] * bool(c)
    r, c = splitter.finish()
    order += [True] * bool(r) + [False] * bool(c)
    return reasoning + r, content + c, order


@pytest.mark.parametrize(("raw", "started", "reasoning", "content"), CASES)
def test_every_split_position(raw: str, started: bool, reasoning: str, content: str) -> None:
    assert split(raw, THINK_MARKERS, started) == (reasoning, content)
    for k in (1, 2):  # one cut at every position, then every pair of cuts
        for cuts in itertools.combinations(range(1, len(raw)), k):
            got_r, got_c, order = _chunked(raw, cuts, started)
            assert (got_r, got_c) == (reasoning, content), cuts
            # reasoning never follows content in the stream
            assert order == sorted(order, reverse=True), cuts


def test_one_character_at_a_time_emits_reasoning_early() -> None:
    splitter = ReasoningSplitter(THINK_MARKERS, started_in_reasoning=True)
    assert splitter.feed("abc") == ("abc", "")
    assert splitter.feed("</") == ("", "")  # may be the closing marker: held
    assert splitter.feed("x") == ("</x", "")
    assert splitter.feed("</think>d") == ("", "d")


def test_markers_chosen_per_template_and_flag() -> None:
    qwen3 = "{%- if enable_thinking %}<think>\n{%- endif %}"
    assert markers_for(qwen3, "auto") == THINK_MARKERS
    assert markers_for("{{ messages }}", "auto") is None
    assert markers_for("{{ messages }}", THINK) == THINK_MARKERS
    assert markers_for(qwen3, NONE) is None


def test_prompt_that_opens_the_block() -> None:
    assert opened_in_prompt("<|im_start|>assistant\n<think>\n", THINK_MARKERS)
    assert not opened_in_prompt("assistant\n<think>\n\n</think>\n\n", THINK_MARKERS)
    assert not opened_in_prompt("<|im_start|>assistant\n", THINK_MARKERS)


def test_unknown_parser_names_the_flag() -> None:
    from inferd.server.options import ServerOptions

    assert ServerOptions(reasoning_parser="none").reasoning_parser == "none"
    with pytest.raises(ValueError, match="--reasoning-parser"):
        ServerOptions(reasoning_parser="deepseek")
