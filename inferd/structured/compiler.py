"""Constraint -> llguidance matcher, compiled off the caller's thread, bounded, and cached.

Compiling (building the lexer and parser tables) can take from microseconds to, for a hostile
schema, as long as llguidance's fuel limits allow. It runs on a small pool of compile threads
(llguidance releases the GIL), and the caller waits at most ``timeout`` seconds: past that the
constraint is refused, and the engine thread (or the event loop) never waited on it. Each
result, a pristine matcher or the error, is cached by the constraint's digest; every request
gets a cheap deep copy of the pristine matcher.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import llguidance

from inferd.structured.constraint import Constraint, ConstraintKind
from inferd.structured.errors import ConstraintError
from inferd.structured.matcher import LazyMatcher, TokenMatcher, TriggerTable
from inferd.structured.vocabulary import Vocabulary

COMPILE_TIMEOUT_S = 10.0
CACHE_ENTRIES = 256
COMPILE_THREADS = 2
# llguidance recurses once per link of a rule chain (Lark ``a0: "x" a1``, or JSON-schema $defs
# each naming the next): a chain that fits MAX_SOURCE_CHARS overflows a default 8 MiB thread
# stack and kills the process. 256 MiB holds the longest chain that fits (measured: 11k Lark
# rules, 5k $defs); it is address space, only the pages a compile touches are ever committed.
COMPILE_STACK_BYTES = 256 * 1024 * 1024
# Compiling is CPU-bound: at normal priority two compile threads take the cores from the
# engine's threads (whose parallel regions then wait on a descheduled peer) and every stream
# stalls. Niced, they run on what inference leaves.
COMPILE_NICE = 10

# JSON layout: one space after ":" and ",", no other whitespace. Free whitespace lets a small
# model pad forever with newlines; this spacing is what models see most in their training.
_JSON_OPTIONS = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,
}
# llguidance's own bounds on grammar size and per-token work (its defaults, set here so they
# are ours to tune): a grammar past them fails to compile instead of stalling.
_LIMITS = llguidance.LLParserLimits(
    max_grammar_size=500_000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000
)


@dataclass(frozen=True, slots=True)
class _Compiled:
    matcher: llguidance.LLMatcher | None
    error: str | None


class GrammarCompiler:
    """Compiles constraints for one model's vocabulary."""

    def __init__(self, vocabulary: Vocabulary, timeout: float = COMPILE_TIMEOUT_S) -> None:
        self.vocabulary = vocabulary
        self.timeout = timeout
        self._pool = _deep_stack_pool()
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, _Compiled] = OrderedDict()
        self._pending: dict[str, concurrent.futures.Future[_Compiled]] = {}
        self._triggers: dict[str, TriggerTable] = {}

    def matcher(self, constraint: Constraint) -> TokenMatcher:
        """A fresh matcher for one request: compiled now (bounded) unless already cached."""
        compiled = self._cached(constraint)
        if compiled is None:
            future = self._submit(constraint)
            try:
                compiled = future.result(self.timeout)
            except concurrent.futures.TimeoutError:
                raise self._timed_out(constraint) from None
        return self._fresh(compiled, constraint)

    async def prepare(self, constraint: Constraint) -> None:
        """Compile ``constraint`` without blocking the event loop; ConstraintError if it fails,
        so that a later ``matcher`` call finds it cached."""
        compiled = self._cached(constraint)
        if compiled is None:
            future = asyncio.wrap_future(self._submit(constraint))
            try:
                compiled = await asyncio.wait_for(asyncio.shield(future), self.timeout)
            except TimeoutError:
                raise self._timed_out(constraint) from None
        if compiled.error is not None:
            raise ConstraintError(compiled.error, _param(constraint))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- internals ----------------------------------------------------------------------------
    def _cached(self, constraint: Constraint) -> _Compiled | None:
        with self._lock:
            compiled = self._cache.get(constraint.digest)
            if compiled is not None:
                self._cache.move_to_end(constraint.digest)
            return compiled

    def _submit(self, constraint: Constraint) -> concurrent.futures.Future[_Compiled]:
        """One compilation per digest at a time: concurrent callers share its future."""
        with self._lock:
            future = self._pending.get(constraint.digest)
            if future is None:
                future = self._pool.submit(self._compile, constraint)
                self._pending[constraint.digest] = future
            return future

    def _compile(self, constraint: Constraint) -> _Compiled:
        try:
            vocab = self.vocabulary
            compiled = _build(vocab.get(), constraint, frozenset(vocab.eos_token_ids))
            if compiled.matcher is not None:
                for trigger in constraint.triggers:  # their tables built here, off the caller
                    self._trigger_table(trigger)
        except Exception as exc:  # a library error is the constraint's problem, not ours
            compiled = _Compiled(None, f"cannot compile the constraint: {exc}")
        with self._lock:
            self._pending.pop(constraint.digest, None)
            self._cache[constraint.digest] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def _fresh(self, compiled: _Compiled, constraint: Constraint) -> TokenMatcher:
        if compiled.matcher is None:
            raise ConstraintError(compiled.error or "invalid constraint", _param(constraint))
        with self._lock:  # deep_copy reads the shared pristine matcher
            copy = compiled.matcher.deep_copy()
        if constraint.triggers:
            # The digest leaves the triggers out: a grammar first compiled eagerly (tool_choice
            # required) has no tables yet; they are built once per trigger.
            tables = tuple(self._trigger_table(t) for t in constraint.triggers)
            return LazyMatcher(None, copy, self.vocabulary.get(), tables=tables)
        return TokenMatcher(copy)

    def _trigger_table(self, trigger: str) -> TriggerTable:
        """Which tokens complete ``trigger`` (built once per trigger, on a compile thread)."""
        with self._lock:
            table = self._triggers.get(trigger)
        if table is None:
            vocab = self.vocabulary
            table = TriggerTable.build(vocab.get(), trigger.encode(), vocab.vocab_size)
            with self._lock:
                self._triggers[trigger] = table
        return table

    def _timed_out(self, constraint: Constraint) -> ConstraintError:
        return ConstraintError(
            f"the {constraint.kind.value} constraint took longer than {self.timeout:g}s to "
            "compile; simplify it",
            _param(constraint),
        )


def _deep_stack_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The compile threads, every one started now with a COMPILE_STACK_BYTES stack: a thread
    takes the stack size set when it starts, and a pool starts its threads on demand."""
    pool = concurrent.futures.ThreadPoolExecutor(
        COMPILE_THREADS, thread_name_prefix="grammar-compile"
    )
    everyone = threading.Barrier(COMPILE_THREADS + 1)
    previous = threading.stack_size(COMPILE_STACK_BYTES)
    try:
        # Each task blocks until all are running, so each one needed a thread of its own.
        for _ in range(COMPILE_THREADS):
            pool.submit(_lower_priority_then_wait, everyone)
        everyone.wait()
    finally:
        threading.stack_size(previous)
    return pool


def _lower_priority_then_wait(everyone: threading.Barrier) -> None:
    # Linux nices one thread by its id; elsewhere the thread keeps the process's priority.
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)
    everyone.wait()


def _build(
    tokenizer: llguidance.LLTokenizer, constraint: Constraint, ends: frozenset[int]
) -> _Compiled:
    matcher = llguidance.LLMatcher(
        tokenizer, _grammar_text(constraint), log_level=0, limits=_LIMITS
    )
    if not matcher.is_error():
        # The first mask builds the lexer's start state; an empty language shows up here.
        matcher.compute_bitmask()
    if matcher.is_error():
        return _Compiled(None, _first_lines(matcher.get_error()))
    failure = _first_step_failure(matcher, ends)
    if failure is not None:
        return _Compiled(None, failure)
    return _Compiled(matcher, None)


def _first_step_failure(matcher: llguidance.LLMatcher, ends: frozenset[int]) -> str | None:
    """Why generation under ``matcher`` would fail at its first token, or None (``ends``: the
    tokens that end a turn).

    Taking a token, llguidance works out the tokens the grammar forces next and gives up past
    its per-step item limit: a constraint that forces an endless or enormous output (an object
    whose required property is the whole schema again, a Lark ``"x"{1000000}``) compiles and
    has a first mask, then refuses the first token sampled under it. A copy walks the start of
    one output: the tokens forced from the start, one token the mask then allows (the lowest
    that does not end the text), and what that forces; an error there is one the engine would
    meet at once. (A forced run reached only after later choices is met when generating.)
    """
    probe = matcher.deep_copy()
    _take_forced(probe)
    if not probe.is_error() and not probe.is_stopped():
        token = _first_allowed(probe.compute_bitmask(), ends)
        if token is not None:
            probe.consume_token(token)
            _take_forced(probe)
        elif not probe.is_accepting() and not probe.is_error():
            return "the constraint allows no output; make a non-empty output possible"
    if not probe.is_error():
        return None
    reason = _first_lines(probe.get_error(), limit=1).removeprefix("parser error: ")
    reason = reason.partition("; try ")[0]  # llguidance's advice there is about its own lexer
    return (
        "the constraint fails at its first token: it forces an output that is endless or too "
        f"long to work out ({reason[:120]}); make a short output possible"
    )


def _take_forced(matcher: llguidance.LLMatcher) -> None:
    """Advance ``matcher`` over the tokens its grammar forces from here (none when in error)."""
    if matcher.is_error() or matcher.is_stopped():
        return
    forced = matcher.compute_ff_tokens()
    if forced and not matcher.is_error():
        matcher.consume_tokens(forced)


def _first_allowed(mask: bytes, skip: frozenset[int]) -> int | None:
    """The lowest token id set in a bitmask (32-bit little-endian words), other than ``skip``."""
    for i, byte in enumerate(mask):
        while byte:
            bit = byte & -byte
            token = i * 8 + bit.bit_length() - 1
            if token not in skip:
                return token
            byte ^= bit
    return None


def _grammar_text(constraint: Constraint) -> str:
    kind, source = constraint.kind, constraint.source
    if kind is ConstraintKind.JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"},
            overrides=_JSON_OPTIONS,  # type: ignore[arg-type]
        )
    if kind is ConstraintKind.JSON_SCHEMA:
        return llguidance.LLMatcher.grammar_from_json_schema(
            source,
            overrides=_JSON_OPTIONS,  # type: ignore[arg-type]
        )
    if kind is ConstraintKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(source)
    if kind is ConstraintKind.CHOICE:
        return llguidance.grammar_from("choice", source)
    if kind is ConstraintKind.LARK:
        return llguidance.LLMatcher.grammar_from_lark(source)
    return llguidance.grammar_from("grammar", source)  # Lark or GBNF


def _param(constraint: Constraint) -> str:
    return {
        ConstraintKind.JSON_OBJECT: "response_format",
        ConstraintKind.JSON_SCHEMA: "response_format",
    }.get(constraint.kind, constraint.kind.value)


def _first_lines(message: str, limit: int = 6) -> str:
    """llguidance's message without the parser-state dump that can follow it."""
    head = message.split("\n<state>", 1)[0].strip()
    return "\n".join(head.splitlines()[:limit])
