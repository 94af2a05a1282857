"""The strict chat-completion stream consumer: head checks, a state machine and outcomes.

Accepted, in order: keep-alive comments (anywhere before ``[DONE]``), chat chunks sharing one
response id, created time and the exact model route, each with exactly one choice at index
0; the assistant role at most once; bounded NUL-free text; no usage before the terminal
chunk; exactly one terminal chunk with a known finish reason; usage (on the terminal chunk
or in one choices-free chunk right after it) with prompt + completion == total and
completion <= max_tokens; exactly one ``[DONE]``; then end of bytes. Anything else is a
``ProtocolError`` naming the rule. Only ``Complete`` is success: partial text after a
dropped connection looks plausible, and that is exactly why it is never promoted.

A run cut short is a ``Cancelled`` typed by who cut it (seed 000 keeps these states apart):

- ``CallerCancelled``: the caller stopped reading and closed the connection (``cancel()``);
- ``ConnectionDropped``: the transport failed mid-stream (a reset, a truncated body);
- ``ServerCancelled``: the server ended the stream with an error event (its own failure,
  a shutdown that cut the request);
- ``SchedulerCancelled``: the server's engine stopped the sequence: its deadline
  (``request_timeout``) or an abort (``abort``).

Each keeps the partial text and what is known of the usage, never invented: the server's own
figures when it sent them before the cut (inferd puts them on its error event when the request
asked for usage), else the output deltas that arrived (a lower bound of what the server
computed: tokens generated after the last read never reach the caller), else nothing
(``tokens_received`` None: not one chunk arrived). ``reconcile.py`` sets these against what
the server recorded.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, TypeVar

from inferd.contract.canonical import canonical_json
from inferd.contract.sse import DecodeLimits, DecodeRule, SseComment, SseDecoder, SseEvent, SseItem
from inferd.contract.tool_calls import ToolCall, ToolCallAssembler, ToolCallError


class Rule(StrEnum):
    """Every way a stream can fail; ``ProtocolError.rule`` is one of these."""

    # the response head
    HTTP_STATUS = "http_status"
    CONTENT_TYPE = "content_type"
    REQUEST_ID_ECHO = "request_id_echo"
    HEADERS_BOUND = "headers_bound"
    # framing, from the decoder
    LINE_TOO_LONG = "line_too_long"
    EVENT_TOO_LARGE = "event_too_large"
    INVALID_UTF8 = "invalid_utf8"
    WIRE_BYTES = "wire_bytes"
    EVENT_COUNT = "event_count"
    BYTES_AFTER_DONE = "bytes_after_done"
    # time
    IDLE_TIMEOUT = "idle_timeout"
    TOTAL_TIMEOUT = "total_timeout"
    # events and chunks
    NAMED_EVENT = "named_event"
    INVALID_JSON = "invalid_json"
    NOT_A_CHUNK = "not_a_chunk"
    RESPONSE_ID = "response_id"
    RESPONSE_ID_DRIFT = "response_id_drift"
    CREATED_DRIFT = "created_drift"
    MODEL_ROUTE = "model_route"
    CHOICE_COUNT = "choice_count"
    CHOICE_INDEX = "choice_index"
    ROLE = "role"
    TEXT = "text"
    TEXT_BOUND = "text_bound"
    USAGE_BEFORE_TERMINAL = "usage_before_terminal"
    UNKNOWN_FINISH_REASON = "unknown_finish_reason"
    CHUNK_AFTER_TERMINAL = "chunk_after_terminal"
    USAGE_INVALID = "usage_invalid"
    USAGE_ARITHMETIC = "usage_arithmetic"
    USAGE_OVER_MAX = "usage_over_max"
    USAGE_MISSING = "usage_missing"
    TERMINAL_MISSING = "terminal_missing"
    DONE_MISSING = "done_missing"
    UNEXPECTED_EOF = "unexpected_eof"
    TOOL_CALL = "tool_call"  # a streamed tool call out of order, renamed or not valid JSON


class OutcomeKind(StrEnum):
    COMPLETE = "complete"
    LENGTH_LIMITED = "incomplete_length_limited"
    TOOL_CALLS = "tool_calls"
    CONTENT_FILTERED = "content_filtered"
    PROTOCOL_ERROR = "protocol_error"
    CALLER_CANCELLED = "cancelled_by_caller"
    CONNECTION_DROPPED = "cancelled_by_connection"
    SERVER_CANCELLED = "cancelled_by_server"
    SCHEDULER_CANCELLED = "cancelled_by_scheduler"


class Canceller(StrEnum):
    """Who cut a run short."""

    CALLER = "caller"
    CONNECTION = "connection"
    SERVER = "server"
    SCHEDULER = "scheduler"


class UsageSource(StrEnum):
    """How a cancelled run's completion tokens are known."""

    SERVER = "server"  # the server's own usage arrived before the cut
    RECEIVED = "received"  # counted as they arrived: a lower bound of what the server computed
    UNKNOWN = "unknown"  # not one chunk arrived: nothing is known


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass(frozen=True)
class Finished:
    """A stream that ended with a terminal chunk, ``[DONE]`` and end of bytes."""

    text: str
    usage: Usage | None
    response_id: str
    created: int
    model: str

    kind: ClassVar[OutcomeKind] = OutcomeKind.COMPLETE
    finish_reason: ClassVar[str | None] = "stop"

    @property
    def ok(self) -> bool:
        return self.kind is OutcomeKind.COMPLETE


@dataclass(frozen=True)
class Complete(Finished):
    pass


@dataclass(frozen=True)
class IncompleteLengthLimited(Finished):
    """The token budget ran out: partial text and usage are kept, but it is not a success."""

    kind = OutcomeKind.LENGTH_LIMITED
    finish_reason = "length"


@dataclass(frozen=True)
class ContentFiltered(Finished):
    kind = OutcomeKind.CONTENT_FILTERED
    finish_reason = "content_filter"


@dataclass(frozen=True)
class ToolCallsRequested(Finished):
    """The model asked for tools; the calls need their own contract, never plain text."""

    tool_calls: tuple[str, ...] = ()  # canonical JSON of each tool_calls delta entry
    calls: tuple[ToolCall, ...] = ()  # the calls assembled, arguments parsed (tool_calls.py)

    kind = OutcomeKind.TOOL_CALLS
    finish_reason = "tool_calls"


@dataclass(frozen=True)
class ProtocolError:
    rule: Rule
    detail: str
    partial_text: str

    kind: ClassVar[OutcomeKind] = OutcomeKind.PROTOCOL_ERROR
    finish_reason: ClassVar[str | None] = None
    ok: ClassVar[bool] = False


@dataclass(frozen=True)
class Cancelled:
    """A run cut short, by whoever ``by`` names; says nothing about whether the server stopped
    computing (see ``reconcile.py``)."""

    partial_text: str
    usage: Usage | None = None  # the server's own figures, when it sent them before the cut
    tokens_received: int | None = None  # output deltas that arrived; None: not one chunk did
    detail: str = ""  # what cut it, sanitized: the transport's error, the server's error event
    code: str | None = None  # the server's error code, when it said why

    kind: ClassVar[OutcomeKind]
    by: ClassVar[Canceller]
    finish_reason: ClassVar[str | None] = None
    ok: ClassVar[bool] = False

    @property
    def usage_source(self) -> UsageSource:
        if self.usage is not None:
            return UsageSource.SERVER
        return UsageSource.UNKNOWN if self.tokens_received is None else UsageSource.RECEIVED

    @property
    def completion_tokens(self) -> int | None:
        """The server's count if it sent one, else the count received, else None (unknown)."""
        return self.usage.completion_tokens if self.usage is not None else self.tokens_received


@dataclass(frozen=True)
class CallerCancelled(Cancelled):
    kind = OutcomeKind.CALLER_CANCELLED
    by = Canceller.CALLER


@dataclass(frozen=True)
class ConnectionDropped(Cancelled):
    kind = OutcomeKind.CONNECTION_DROPPED
    by = Canceller.CONNECTION


@dataclass(frozen=True)
class ServerCancelled(Cancelled):
    kind = OutcomeKind.SERVER_CANCELLED
    by = Canceller.SERVER


@dataclass(frozen=True)
class SchedulerCancelled(Cancelled):
    kind = OutcomeKind.SCHEDULER_CANCELLED
    by = Canceller.SCHEDULER


_C = TypeVar("_C", bound=Cancelled)

# Error codes by which the server says its engine stopped the sequence, not that it failed:
# inferd's deadline (--request-timeout) and an engine abort (the model unloaded under it).
SCHEDULER_CODES = frozenset({"request_timeout", "abort"})


Outcome = (
    Complete
    | IncompleteLengthLimited
    | ContentFiltered
    | ToolCallsRequested
    | ProtocolError
    | CallerCancelled
    | ConnectionDropped
    | ServerCancelled
    | SchedulerCancelled
)


def outcome_text(outcome: Outcome) -> str:
    """The text a stream produced: all of it when it finished, what arrived otherwise."""
    return outcome.text if isinstance(outcome, Finished) else outcome.partial_text


_Terminal = Complete | IncompleteLengthLimited | ContentFiltered | ToolCallsRequested
_FINISHED: dict[str, type[_Terminal]] = {
    "stop": Complete,
    "length": IncompleteLengthLimited,
    "content_filter": ContentFiltered,
    "tool_calls": ToolCallsRequested,
}


@dataclass(frozen=True)
class StreamLimits:
    max_wire_bytes: int = 4 << 20
    max_events: int = 20_000
    max_line_bytes: int = 64 << 10
    max_event_bytes: int = 256 << 10
    max_text_bytes: int = 1 << 20
    max_response_id_chars: int = 128
    idle_timeout_s: float = 60.0
    total_timeout_s: float = 600.0
    max_header_count: int = 64
    max_header_bytes: int = 16 << 10
    max_error_body_bytes: int = 512

    def decode_limits(self) -> DecodeLimits:
        return DecodeLimits(
            max_line_bytes=self.max_line_bytes,
            max_event_bytes=self.max_event_bytes,
            max_wire_bytes=self.max_wire_bytes,
            max_items=self.max_events,
        )


@dataclass(frozen=True)
class Expectation:
    """What the request promised, which every chunk is checked against."""

    model_route: str
    max_tokens: int
    require_usage: bool


class _Violation(Exception):
    def __init__(self, rule: Rule, detail: str) -> None:
        super().__init__(detail)
        self.rule = rule
        self.detail = detail


class _Phase(StrEnum):
    OPEN = "open"  # no chunk yet, or chunks without a finish reason
    TERMINATED = "terminated"  # the finish reason has arrived
    DONE = "done"  # [DONE] has arrived; only end of bytes may follow


_RESPONSE_ID = re.compile(r"^[A-Za-z0-9._:\-]+$")
_DECODE_RULES = {r: Rule(r.value) for r in DecodeRule}


class StreamConsumer:
    """Feed it the body bytes as they arrive; ``finish()`` at end of bytes gives the outcome.

    ``at`` is a monotonic timestamp of each read, used for the idle-gap and total-time
    bounds; fixtures leave it out. The digest covers every byte fed, even after a failure,
    so a receipt names the exact wire bytes however they were split.
    """

    def __init__(
        self,
        expect: Expectation,
        limits: StreamLimits | None = None,
        *,
        started_at: float | None = None,
    ) -> None:
        self.expect = expect
        self.limits = limits or StreamLimits()
        self._decoder = SseDecoder(self.limits.decode_limits())
        self._hash = hashlib.sha256()
        self.wire_bytes = 0
        self.events = 0
        self.keepalives = 0
        self._outcome: Outcome | None = None
        self._phase = _Phase.OPEN
        self._text: list[str] = []
        self._text_bytes = 0
        self._tool_calls: list[str] = []
        self._tokens_received = 0  # chunks whose delta carried output: one decode step each
        self._assembler = ToolCallAssembler(self.limits.max_text_bytes)
        self._role_seen = False
        self._envelope: tuple[str, int] | None = None
        self._finish: type[_Terminal] | None = None
        self._usage: Usage | None = None
        # When the request was sent, so the wait for the first byte counts as an idle gap.
        self._started: float | None = started_at
        self._last: float | None = started_at

    # -- public --------------------------------------------------------------------------
    @property
    def outcome(self) -> Outcome | None:
        """The outcome once decided: a failure as soon as it happens, success only at EOF."""
        return self._outcome

    @property
    def failed(self) -> bool:
        return self._outcome is not None

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def tokens_received(self) -> int:
        """Chunks so far whose delta carried output (see ``_delta``)."""
        return self._tokens_received

    @property
    def wire_sha256(self) -> str:
        return self._hash.hexdigest()

    def feed(self, data: bytes, at: float | None = None) -> None:
        self._hash.update(data)
        self.wire_bytes += len(data)
        if self._outcome is not None:
            return
        if not self._check_time(at):
            return
        items = self._decoder.feed(data)
        self._accept(items)
        error = self._decoder.error
        if self._outcome is None and error is not None:
            self._fail(_DECODE_RULES[error.rule], error.detail)

    def finish(self, at: float | None = None) -> Outcome:
        """End of bytes: the only point at which a stream can be ``Complete``."""
        if self._outcome is None and self._check_time(at):
            self._outcome = self._at_eof()
        assert self._outcome is not None
        return self._outcome

    def cancel(self) -> Outcome:
        """The caller stops reading. A decided outcome stays; anything else (even after
        ``[DONE]``: end of bytes never came) is ``CallerCancelled``."""
        if self._outcome is None:
            self._outcome = self._cancelled(CallerCancelled)
        return self._outcome

    def transport_failed(self, detail: str) -> Outcome:
        """The connection failed before end of bytes: ``ConnectionDropped``."""
        if self._outcome is None:
            self._outcome = self._cancelled(ConnectionDropped, detail)
        return self._outcome

    def timed_out(self) -> Outcome:
        """The transport's read timed out: the idle gap was exceeded."""
        if self._outcome is None:
            self._fail(Rule.IDLE_TIMEOUT, f"no bytes for {self.limits.idle_timeout_s}s")
        assert self._outcome is not None
        return self._outcome

    # -- internals -----------------------------------------------------------------------
    def _fail(self, rule: Rule, detail: str) -> None:
        self._outcome = ProtocolError(rule, detail, self.text)

    def _cancelled(self, cancelled: type[_C], detail: str = "", code: str | None = None) -> _C:
        received = None if self._envelope is None else self._tokens_received
        return cancelled(self.text, self._usage, received, detail, code)

    def _check_time(self, at: float | None) -> bool:
        if at is None:
            return True
        if self._started is None:
            self._started = self._last = at
        assert self._last is not None
        if at - self._last > self.limits.idle_timeout_s:
            self._fail(Rule.IDLE_TIMEOUT, f"no bytes for more than {self.limits.idle_timeout_s}s")
        elif at - self._started > self.limits.total_timeout_s:
            self._fail(Rule.TOTAL_TIMEOUT, f"stream longer than {self.limits.total_timeout_s}s")
        self._last = at
        return self._outcome is None

    def _accept(self, items: Iterable[SseItem]) -> None:
        for item in items:
            if self._outcome is not None:  # the server ended the stream: the rest is moot
                return
            try:
                self._item(item)
            except _Violation as v:
                self._fail(v.rule, v.detail)
                return

    def _item(self, item: SseItem) -> None:
        if isinstance(item, SseComment):
            self.keepalives += 1
            return
        self.events += 1
        self._event(item)

    def _event(self, event: SseEvent) -> None:
        if event.event != "message":
            raise _Violation(
                Rule.NAMED_EVENT, f"event {event.event[:64]!r} is not in this contract"
            )
        if event.data == "[DONE]":
            self._done()
            return
        chunk = _parse_json(event.data)
        if "error" in chunk and "object" not in chunk:
            self._server_ended(chunk)
            return
        self._check_envelope(chunk)
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            raise _Violation(Rule.NOT_A_CHUNK, "choices must be a list")
        usage = chunk.get("usage")
        if self._phase is _Phase.OPEN:
            self._open_chunk(choices, usage)
        else:
            self._after_terminal(choices, usage)

    def _server_ended(self, event: dict[str, Any]) -> None:
        """An error event: the server cut the run. Its engine (a deadline, an abort) or
        itself (a failure, a shutdown), by the error's code; its usage, if it sent one."""
        error = event["error"]
        code = error.get("code") if isinstance(error, dict) else None
        code = sanitize_text(code, 64) if isinstance(code, str) else None
        if event.get("usage") is not None:
            self._usage = _usage(event["usage"], self.expect.max_tokens)
        detail = _error_summary(error)
        if code in SCHEDULER_CODES:
            self._outcome = self._cancelled(SchedulerCancelled, detail, code)
        else:
            self._outcome = self._cancelled(ServerCancelled, detail, code)

    def _check_envelope(self, chunk: dict[str, Any]) -> None:
        if chunk.get("object") != "chat.completion.chunk":
            raise _Violation(Rule.NOT_A_CHUNK, "object must be chat.completion.chunk")
        rid, created, model = chunk.get("id"), chunk.get("created"), chunk.get("model")
        if not _valid_response_id(rid, self.limits.max_response_id_chars):
            raise _Violation(Rule.RESPONSE_ID, "id must be a short token")
        if not isinstance(created, int) or isinstance(created, bool) or created < 0:
            raise _Violation(Rule.NOT_A_CHUNK, "created must be a non-negative integer")
        if model != self.expect.model_route:
            raise _Violation(Rule.MODEL_ROUTE, "model differs from the requested route")
        assert isinstance(rid, str)
        if self._envelope is None:
            self._envelope = (rid, created)
        elif rid != self._envelope[0]:
            raise _Violation(Rule.RESPONSE_ID_DRIFT, "id changed within the stream")
        elif created != self._envelope[1]:
            raise _Violation(Rule.CREATED_DRIFT, "created changed within the stream")

    def _open_chunk(self, choices: list[Any], usage: object) -> None:
        if len(choices) != 1:
            if not choices and usage is not None:
                raise _Violation(Rule.USAGE_BEFORE_TERMINAL, "usage arrived before a finish reason")
            raise _Violation(Rule.CHOICE_COUNT, f"{len(choices)} choices; exactly one expected")
        finish = self._choice(choices[0])
        if finish is None:
            if usage is not None:
                raise _Violation(Rule.USAGE_BEFORE_TERMINAL, "usage arrived before a finish reason")
            return
        self._finish = finish
        self._phase = _Phase.TERMINATED
        if usage is not None:
            self._usage = _usage(usage, self.expect.max_tokens)

    def _after_terminal(self, choices: list[Any], usage: object) -> None:
        if choices:
            finished = any(isinstance(c, dict) and c.get("finish_reason") for c in choices)
            what = "a second finish reason" if finished else "a chunk"
            raise _Violation(Rule.CHUNK_AFTER_TERMINAL, f"{what} after the terminal chunk")
        if usage is None or self._usage is not None:
            raise _Violation(
                Rule.CHUNK_AFTER_TERMINAL, "only one usage chunk may follow the terminal"
            )
        self._usage = _usage(usage, self.expect.max_tokens)

    def _choice(self, choice: object) -> type[_Terminal] | None:
        if not isinstance(choice, dict):
            raise _Violation(Rule.NOT_A_CHUNK, "a choice must be an object")
        index = choice.get("index")
        if index != 0 or isinstance(index, bool):
            raise _Violation(Rule.CHOICE_INDEX, f"choice index {index!r}; only 0 is expected")
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            raise _Violation(Rule.NOT_A_CHUNK, "delta must be an object")
        self._delta(delta)
        reason = choice.get("finish_reason")
        if reason is None:
            return None
        if not isinstance(reason, str) or reason not in _FINISHED:
            raise _Violation(Rule.UNKNOWN_FINISH_REASON, f"finish_reason {str(reason)[:32]!r}")
        return _FINISHED[reason]

    def _delta(self, delta: dict[str, Any]) -> None:
        # inferd (and vLLM) stream one decode step per chunk, so this counts tokens; a step
        # whose text is held back (part of a character) sends none, so it is a lower bound.
        if any(delta.get(k) for k in ("content", "reasoning_content", "tool_calls")):
            self._tokens_received += 1
        role = delta.get("role")
        if role is not None:
            if role != "assistant" or self._role_seen:
                raise _Violation(Rule.ROLE, "the assistant role must appear at most once")
            self._role_seen = True
        content = delta.get("content")
        if content is not None:
            if not isinstance(content, str) or "\x00" in content:
                raise _Violation(Rule.TEXT, "content must be a NUL-free string")
            self._add_output(content)
            self._text.append(content)
        calls = delta.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise _Violation(Rule.NOT_A_CHUNK, "tool_calls must be a list")
            for call in calls:
                encoded = canonical_json(call).decode("utf-8")
                self._add_output(encoded)
                self._tool_calls.append(encoded)
                try:
                    self._assembler.add(call)
                except ToolCallError as exc:
                    raise _Violation(Rule.TOOL_CALL, str(exc)) from None

    def _add_output(self, text: str) -> None:
        self._text_bytes += len(text.encode("utf-8"))
        if self._text_bytes > self.limits.max_text_bytes:
            raise _Violation(Rule.TEXT_BOUND, f"output over {self.limits.max_text_bytes} bytes")

    def _done(self) -> None:
        if self._phase is _Phase.OPEN:
            raise _Violation(Rule.TERMINAL_MISSING, "[DONE] before a finish reason")
        if self.expect.require_usage and self._usage is None:
            raise _Violation(Rule.USAGE_MISSING, "[DONE] without the requested usage")
        self._phase = _Phase.DONE

    def _at_eof(self) -> Outcome:
        if self._phase is _Phase.OPEN:
            return ProtocolError(
                Rule.UNEXPECTED_EOF, "end of bytes before a finish reason", self.text
            )
        if self._phase is _Phase.TERMINATED:
            return ProtocolError(Rule.DONE_MISSING, "end of bytes without [DONE]", self.text)
        assert self._finish is not None and self._envelope is not None
        rid, created = self._envelope
        common = (self.text, self._usage, rid, created, self.expect.model_route)
        if self._finish is ToolCallsRequested:
            try:
                assembled = self._assembler.finish()
            except ToolCallError as exc:
                return ProtocolError(Rule.TOOL_CALL, str(exc), self.text)
            return ToolCallsRequested(*common, tool_calls=tuple(self._tool_calls), calls=assembled)
        if self._assembler.started and self._finish is Complete:
            return ProtocolError(Rule.TOOL_CALL, "tool calls with finish_reason stop", self.text)
        return self._finish(*common)


def _parse_json(data: str) -> dict[str, Any]:
    try:
        value = json.loads(data, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise _Violation(Rule.INVALID_JSON, f"data is not JSON: {str(exc)[:80]}") from None
    if not isinstance(value, dict):
        raise _Violation(Rule.NOT_A_CHUNK, "data must be a JSON object")
    return value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # A duplicated key lets two parsers read two different chunks from one byte string.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key[:32]!r}")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _valid_response_id(value: object, max_chars: int) -> bool:
    return (
        isinstance(value, str) and 0 < len(value) <= max_chars and bool(_RESPONSE_ID.match(value))
    )


def _usage(value: object, max_tokens: int) -> Usage:
    if not isinstance(value, dict):
        raise _Violation(Rule.USAGE_INVALID, "usage must be an object")
    counts = []
    for name in ("prompt_tokens", "completion_tokens", "total_tokens"):
        n = value.get(name)
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise _Violation(Rule.USAGE_INVALID, f"usage.{name} must be a non-negative integer")
        counts.append(n)
    usage = Usage(*counts)
    if usage.prompt_tokens + usage.completion_tokens != usage.total_tokens:
        raise _Violation(Rule.USAGE_ARITHMETIC, "prompt_tokens + completion_tokens != total_tokens")
    if usage.completion_tokens > max_tokens:
        raise _Violation(Rule.USAGE_OVER_MAX, f"completion_tokens over max_tokens {max_tokens}")
    return usage


def _error_summary(error: object) -> str:
    """A short, sanitized description of an in-stream error object."""
    if not isinstance(error, dict):
        return "the server sent an error event"
    parts = [str(error.get(k))[:64] for k in ("type", "code") if error.get(k) is not None]
    message = error.get("message")
    if isinstance(message, str):
        parts.append(sanitize_text(message, 160))
    return "server error: " + " / ".join(parts)


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://\S*")
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]+")


def sanitize_text(text: str, limit: int) -> str:
    """Printable ASCII only, URLs (which may name media paths) redacted, at most ``limit``."""
    text = _URL.sub("<url>", text)
    text = _UNPRINTABLE.sub(" ", text)
    return " ".join(text.split())[:limit]


# -- the response head -----------------------------------------------------------------------
def check_head(
    status: int,
    headers: list[tuple[str, str]],
    sent_request_id: str,
    limits: StreamLimits,
) -> tuple[Rule, str] | None:
    """Before reading the body: bounded headers, 2xx, text/event-stream, echoed request id."""
    size = sum(len(k) + len(v) + 4 for k, v in headers)
    if len(headers) > limits.max_header_count or size > limits.max_header_bytes:
        return Rule.HEADERS_BOUND, f"{len(headers)} headers, {size} bytes"
    if not 200 <= status < 300:
        return Rule.HTTP_STATUS, f"HTTP {status}"
    lookup = _header_map(headers)
    content_types = lookup.get("content-type", [])
    media = content_types[0].split(";")[0].strip().lower() if len(content_types) == 1 else ""
    if media != "text/event-stream":
        return Rule.CONTENT_TYPE, f"content type {sanitize_text(media, 64)!r}"
    if lookup.get("x-request-id", []) != [sent_request_id]:
        return Rule.REQUEST_ID_ECHO, "x-request-id was not echoed exactly once"
    return None


def _header_map(headers: list[tuple[str, str]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for key, value in headers:
        out.setdefault(key.lower(), []).append(value)
    return out


def error_body_summary(prefix: bytes, limit: int = 200) -> str:
    """What a non-2xx body may contribute to a diagnosis: a known envelope, sanitized."""
    text = prefix.decode("utf-8", errors="replace")
    try:
        body = json.loads(text)
    except ValueError:
        return sanitize_text(text, limit)
    if isinstance(body, dict) and "error" in body:
        return _error_summary(body["error"])[:limit]
    return sanitize_text(text, limit)
