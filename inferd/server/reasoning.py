"""Reasoning ("thinking") split from the answer, as the model's text streams in.

A reasoning model writes ``<think> ... </think>`` before its answer (Qwen3, DeepSeek-R1); the
APIs carry the two apart (chat's ``reasoning_content``, a Responses ``reasoning`` item, an
Anthropic ``thinking`` block). ``ReasoningSplitter`` is fed the text as it comes and returns
(reasoning, content) pieces; a marker split across chunks at any position is held back until
it is whole or proven not to be one. Whether a model's output is split at all is decided once
per template (``markers_for``): the template mentions the markers, or ``--reasoning-parser``
says so (``none`` turns it off).

One think block is recognized: at the very start of the output (after whitespace), or already
opened by the prompt (a generation prompt ending in ``<think>\\n``: the output starts in
reasoning). After the block closes, everything is content, markers and all; a block that never
closes leaves the whole output as reasoning. Nothing is dropped but the two markers, so
``reasoning + content`` is the raw text without them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING

from inferd.serving.interface import ThinkingSpec

if TYPE_CHECKING:
    from collections.abc import Sequence

    from inferd.serving.interface import SamplingParams
    from inferd.serving.served import ServedModel

AUTO = "auto"  # split when the chat template mentions the markers
NONE = "none"  # never split
THINK = "think"  # always split on <think> ... </think>
PARSERS = (AUTO, NONE, THINK)


@dataclass(frozen=True, slots=True)
class Markers:
    open: str = "<think>"
    close: str = "</think>"


THINK_MARKERS = Markers()


@functools.cache
def markers_for(template_source: str, parser: str) -> Markers | None:
    """The markers to split on for a model with this template, or None (no split)."""
    if parser == NONE:
        return None
    if parser == THINK:
        return THINK_MARKERS
    mentioned = THINK_MARKERS.open in template_source or THINK_MARKERS.close in template_source
    return THINK_MARKERS if mentioned else None


# Variables a request may not set: the server's own (the conversation, the special tokens).
_RESERVED = frozenset(
    {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "documents"}
)


def template_variables(given: dict[str, object] | None) -> dict[str, object]:
    """A request's extra chat template variables (``chat_template_kwargs``), checked: plain
    names with scalar values, none of the server's own. ValueError says what is wrong."""
    out: dict[str, object] = {}
    for name, value in (given or {}).items():
        if not name.isidentifier() or name in _RESERVED:
            raise ValueError(f"{name!r} cannot be set")
        if value is not None and not isinstance(value, bool | int | float | str):
            raise ValueError(f"{name!r} must be a string, number, boolean or null")
        out[name] = value
    return out


def opened_in_prompt(prompt_tail: str, markers: Markers) -> bool:
    """Whether the prompt ends inside an open think block (the output starts in reasoning)."""
    opened = prompt_tail.rfind(markers.open)
    return opened >= 0 and prompt_tail.rfind(markers.close) < opened


# Enough of the prompt's end to hold a generation prompt that opens a think block.
_PROMPT_TAIL_TOKENS = 16


@dataclass(frozen=True, slots=True)
class ReasoningSplit:
    """How one reply splits: on these markers, starting in reasoning or not."""

    markers: Markers
    started_in_reasoning: bool

    def splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(self.markers, self.started_in_reasoning)

    def split(self, text: str) -> tuple[str, str]:
        return split(text, self.markers, self.started_in_reasoning)


def followed(
    params: SamplingParams,
    model: ServedModel,
    split: ReasoningSplit | None,
    budget: int | None = None,
) -> SamplingParams:
    """``params`` with the engine told about the think block (engine/thinking.py): it counts
    the reasoning tokens for ``usage``, and past ``budget`` reasoning tokens closes the block
    with the closing marker's tokens so the model goes on to its answer."""
    if split is None:
        return params
    close_ids = tuple(model.tokenizer.encode(split.markers.close))
    spec = ThinkingSpec(
        split.markers.open, split.markers.close, close_ids, split.started_in_reasoning, budget
    )
    return replace(params, thinking=spec)


def reasoning_split(
    model: ServedModel, prompt: Sequence[int], parser: str
) -> ReasoningSplit | None:
    """The split for ``model``'s reply to ``prompt`` (token ids), or None when not splitting.
    The prompt's tail is decoded with its special tokens to see whether it opened the block."""
    markers = markers_for(model.chat_template.source, parser)
    if markers is None:
        return None
    tail = model.tokenizer.decode(prompt[-_PROMPT_TAIL_TOKENS:], skip_special=False)
    return ReasoningSplit(markers, opened_in_prompt(tail, markers))


class _State(Enum):
    START = 1  # nothing decided: an opening marker may still come (after whitespace)
    REASONING = 2
    CONTENT = 3


@dataclass(slots=True)
class ReasoningSplitter:
    markers: Markers
    started_in_reasoning: bool = False
    _state: _State = _State.START
    _held: str = ""  # text that may be the start of a marker

    def __post_init__(self) -> None:
        if self.started_in_reasoning:
            self._state = _State.REASONING

    @property
    def in_reasoning(self) -> bool:
        return self._state is _State.REASONING

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) this chunk makes certain; either may be empty."""
        self._held += text
        reasoning = content = ""
        if self._state is _State.START:
            reasoning, decided = self._start()
            if not decided:
                return "", ""
        if self._state is _State.REASONING:
            more, content = self._reasoning()
            reasoning += more
        if self._state is _State.CONTENT:
            content += self._held
            self._held = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output is over (an unfinished marker is plain text)."""
        held, self._held = self._held, ""
        return (held, "") if self._state is _State.REASONING else ("", held)

    def _start(self) -> tuple[str, bool]:
        """Decide whether the output opens a think block; the whitespace before it is
        reasoning. Returns (reasoning so far, decided)."""
        opener = self.markers.open
        stripped = self._held.lstrip()
        if len(stripped) < len(opener) and opener.startswith(stripped):
            return "", False  # all whitespace, or a prefix of the marker: wait
        if not stripped.startswith(opener):
            self._state = _State.CONTENT
            return "", True
        lead = self._held[: len(self._held) - len(stripped)]
        self._held = stripped[len(opener) :]
        self._state = _State.REASONING
        return lead, True

    def _reasoning(self) -> tuple[str, str]:
        closer = self.markers.close
        at = self._held.find(closer)
        if at >= 0:
            reasoning, self._held = self._held[:at], self._held[at + len(closer) :]
            self._state = _State.CONTENT
            return reasoning, ""
        keep = _partial_suffix(self._held, closer)
        cut = len(self._held) - keep
        reasoning, self._held = self._held[:cut], self._held[cut:]
        return reasoning, ""


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (and is not all of it)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def split(text: str, markers: Markers, started_in_reasoning: bool = False) -> tuple[str, str]:
    """A whole output's (reasoning, content)."""
    splitter = ReasoningSplitter(markers, started_in_reasoning)
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.finish()
    return reasoning + more_reasoning, content + more_content
