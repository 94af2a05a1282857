"""An incremental, bounded Server-Sent Events decoder.

Bytes arrive in arbitrary pieces: a line, a CRLF pair or a UTF-8 sequence can be split
across reads, and one read may hold many events. The decoder keeps a bounded buffer,
recognizes LF, CRLF and CR line ends, decodes only complete lines (a UTF-8 sequence never
contains CR or LF bytes, so a complete line is always a complete sequence), and stops at
the first violation. Its output depends only on the concatenated bytes, never on where
they were split: every check fires at the same byte position however the input is cut.

Two deliberate departures from the HTML living standard, both to fail closed:
an ``event:`` block without data is dispatched (the standard drops it silently, which
would hide an unexpected named event), and any byte after the terminal data line
(``[DONE]``) is an error rather than more events.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

_EOL = re.compile(rb"[\r\n]")
_CR, _LF = 0x0D, 0x0A


class DecodeRule(StrEnum):
    LINE_TOO_LONG = "line_too_long"
    EVENT_TOO_LARGE = "event_too_large"
    INVALID_UTF8 = "invalid_utf8"
    WIRE_BYTES = "wire_bytes"
    EVENT_COUNT = "event_count"
    BYTES_AFTER_DONE = "bytes_after_done"


@dataclass(frozen=True)
class DecodeLimits:
    max_line_bytes: int = 64 << 10
    max_event_bytes: int = 256 << 10
    max_wire_bytes: int = 8 << 20
    max_items: int = 100_000  # events and comments together: keep-alives count too


@dataclass(frozen=True)
class SseEvent:
    event: str  # "message" unless an event: field named it
    data: str


@dataclass(frozen=True)
class SseComment:
    text: str


SseItem = SseEvent | SseComment


@dataclass(frozen=True)
class DecodeFailure:
    rule: DecodeRule
    detail: str


class SseDecoder:
    """Bytes in, ``SseEvent`` and ``SseComment`` items out; stops at the first violation.

    ``terminal_data`` is the data of the last event a stream may carry (``[DONE]`` for
    chat completions); any byte after it is a violation. None disables that check.
    """

    def __init__(
        self, limits: DecodeLimits | None = None, terminal_data: str | None = "[DONE]"
    ) -> None:
        self.limits = limits or DecodeLimits()
        self.terminal_data = terminal_data
        self.wire_bytes = 0
        self.items = 0
        self.error: DecodeFailure | None = None
        self.terminated = False
        self._buf = bytearray()
        self._scan = 0  # bytes of _buf already known to hold no line end
        self._skip_lf = False  # the previous line ended in CR; a following LF belongs to it
        self._first_line = True
        self._data: list[str] = []
        self._event_bytes = 0
        self._event_type = ""

    def feed(self, data: bytes) -> list[SseItem]:
        """Decode ``data``; returns the items completed by it, in order.

        After a failure (see ``error``) nothing more is decoded. Items completed before
        the failing byte are still returned, so that a caller checking items before the
        decoder's error sees violations in byte order.
        """
        out: list[SseItem] = []
        if self.error is not None or not data:
            return out
        room = self.limits.max_wire_bytes - self.wire_bytes
        accepted = data[:room]
        self.wire_bytes += len(accepted)
        self._consume(accepted, out)
        if len(data) > room and self.error is None:
            self._fail(DecodeRule.WIRE_BYTES, f"more than {self.limits.max_wire_bytes} bytes")
        return out

    def _consume(self, chunk: bytes, out: list[SseItem]) -> None:
        if self._skip_lf and chunk:
            self._skip_lf = False
            if chunk[0] == _LF:
                chunk = chunk[1:]
        if not chunk:
            return
        if self.terminated:
            self._fail(DecodeRule.BYTES_AFTER_DONE, "bytes follow the terminal event")
            return
        self._buf += chunk
        while self.error is None:
            match = _EOL.search(self._buf, self._scan)
            if match is None:
                self._scan = len(self._buf)
                if self._scan > self.limits.max_line_bytes:
                    self._line_too_long()
                return
            self._take_line(match.start(), out)
            if self.terminated and self._buf and self.error is None:
                self._fail(DecodeRule.BYTES_AFTER_DONE, "bytes follow the terminal event")

    def _take_line(self, end: int, out: list[SseItem]) -> None:
        line = bytes(self._buf[:end])
        consumed = end + 1
        if self._buf[end] == _CR:
            if end + 1 < len(self._buf):
                consumed += self._buf[end + 1] == _LF
            else:
                self._skip_lf = True
        del self._buf[:consumed]
        self._scan = 0
        self._line(line, out)

    def _line(self, raw: bytes, out: list[SseItem]) -> None:
        if len(raw) > self.limits.max_line_bytes:
            self._line_too_long()
            return
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            self._fail(DecodeRule.INVALID_UTF8, f"invalid UTF-8 at line byte {exc.start}")
            return
        if self._first_line:
            self._first_line = False
            line = line.removeprefix("\ufeff")
        if not line:
            self._dispatch(out)
        elif line.startswith(":"):
            self._emit(SseComment(line[1:].removeprefix(" ")), out)
        else:
            self._field(line)

    def _field(self, line: str) -> None:
        name, colon, value = line.partition(":")
        if colon:
            value = value.removeprefix(" ")
        if name == "data":
            self._event_bytes += len(value.encode("utf-8")) + 1
            if self._event_bytes > self.limits.max_event_bytes:
                self._fail(
                    DecodeRule.EVENT_TOO_LARGE, f"an event over {self.limits.max_event_bytes} bytes"
                )
                return
            self._data.append(value)
        elif name == "event":
            self._event_type = value
        # id, retry and unknown fields carry nothing this client acts on (no reconnection:
        # a resumed stream would not be the same run), so they are ignored as the standard says.

    def _dispatch(self, out: list[SseItem]) -> None:
        if not self._data and not self._event_type:
            return
        event = SseEvent(self._event_type or "message", "\n".join(self._data))
        self._data, self._event_bytes, self._event_type = [], 0, ""
        self._emit(event, out)
        if (
            self.error is None
            and self.terminal_data is not None
            and event.data == self.terminal_data
        ):
            self.terminated = True

    def _emit(self, item: SseItem, out: list[SseItem]) -> None:
        self.items += 1
        if self.items > self.limits.max_items:
            self._fail(DecodeRule.EVENT_COUNT, f"more than {self.limits.max_items} events")
            return
        out.append(item)

    def _line_too_long(self) -> None:
        # One message whether the line was seen whole or still open: the outcome must not
        # depend on where the bytes were split.
        self._fail(DecodeRule.LINE_TOO_LONG, f"a line over {self.limits.max_line_bytes} bytes")

    def _fail(self, rule: DecodeRule, detail: str) -> None:
        if self.error is None:
            self.error = DecodeFailure(rule, detail)
