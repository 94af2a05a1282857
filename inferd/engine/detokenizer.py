"""Incremental detokenization: bytes in, whole UTF-8 characters out, stop strings held back.

Tokens of a byte-level vocabulary can end in the middle of a multi-byte character, so text is
decoded from the running byte stream with an incremental UTF-8 decoder. A suffix that could still
grow into a stop string is held back until it either completes (the request stops and the stop
string is never emitted) or diverges (it is released).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DetokenizerStep:
    text: str  # newly releasable text (may be empty)
    stop_string: str | None  # the stop string that matched, if any


class IncrementalDetokenizer:
    def __init__(
        self,
        token_bytes: Callable[[int], bytes],
        skip_ids: frozenset[int] = frozenset(),
        stop: Sequence[str] = (),
    ) -> None:
        self._token_bytes = token_bytes
        self._skip_ids = skip_ids
        self._stop = tuple(stop)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""
        self._emitted = 0  # characters of _text already released
        self._scan_from = 0  # stop strings cannot start before this index

    @property
    def text(self) -> str:
        """Everything released so far."""
        return self._text[: self._emitted]

    def push(self, token_id: int) -> DetokenizerStep:
        if token_id in self._skip_ids:
            return DetokenizerStep("", None)
        self._text += self._decoder.decode(self._token_bytes(token_id))
        return self._release()

    def flush(self) -> str:
        """At the end of generation: release held-back text and any dangling partial character."""
        self._text += self._decoder.decode(b"", final=True)
        delta = self._text[self._emitted :]
        self._emitted = len(self._text)
        return delta

    def _release(self) -> DetokenizerStep:
        if self._stop:
            hit = self._find_stop()
            if hit is not None:
                index, stop = hit
                delta = self._text[self._emitted : index]
                self._text = self._text[:index]
                self._emitted = index
                return DetokenizerStep(delta, stop)
        end = len(self._text) - self._held_back()
        delta = self._text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        longest = max((len(s) for s in self._stop), default=1)
        self._scan_from = max(0, len(self._text) - longest + 1)
        return DetokenizerStep(delta, None)

    def _find_stop(self) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = self._text.find(stop, self._scan_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _held_back(self) -> int:
        """Length of the longest unreleased suffix that is a prefix of some stop string."""
        tail = self._text[self._emitted :]
        held = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(tail)), held, -1):
                if tail.endswith(stop[:n]):
                    held = n
                    break
        return held
