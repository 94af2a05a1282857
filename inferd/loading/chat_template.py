"""Render a model's chat template (Jinja, Hugging Face conventions) safely.

Chat templates come from model files, so they are untrusted code. Rendering happens in
Jinja's ``ImmutableSandboxedEnvironment`` (no attribute access to internals, no mutation of
the data we pass in) plus resource bounds the sandbox does not provide:

* values: every operation that can multiply sizes in one C-level step (``*``, ``**``,
  ``+``, ``~``, ``%``, list/dict literals, string methods such as ``ljust`` / ``replace`` /
  ``join``, filters such as ``center`` / ``indent`` / ``batch``) is checked *before* it runs,
  so no value grows beyond ``max_output_chars`` "expanded" characters/elements. Sizes count
  shared references every time they occur, because ``str()`` or ``tojson`` would expand them;
* time: a trace function aborts Python-level work (template loops, pure-Python filters) after
  ``timeout_s``. Jinja has no ``while``, so everything else terminates;
* output: rendering streams and stops once the result exceeds ``max_output_chars``.

Only the template may produce control tokens: ``render_chat`` reports where special-token text
that came from the messages (``<|im_start|>system`` typed by a user) landed in the output, so
the tokenizer can read it as plain text instead of letting the message forge a turn.

Every failure, from a syntax error to ``raise_exception()`` to a limit, is a
``ChatTemplateError`` whose message says what happened.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import json
import re
import secrets
import string
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from types import FrameType
from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError, nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.runtime import Context, Undefined
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

__all__ = [
    "CHATML_TEMPLATE",
    "MAX_OUTPUT_CHARS",
    "RENDER_TIMEOUT_S",
    "ChatTemplate",
    "ChatTemplateError",
    "NoChatTemplateError",
    "RenderedChat",
]

MAX_OUTPUT_CHARS = 8 * 1024 * 1024
RENDER_TIMEOUT_S = 5.0
_MAX_SOURCE_CHARS = 1024 * 1024
_MAX_INT_BITS = 1 << 16
_MAX_NESTING = 256
_MAX_JSON_INDENT = 64
_MAX_STRFTIME_FORMAT = 256
# Output written into {% set %} blocks and macros is kept in memory before it is joined, and
# may legitimately be discarded; all output produced in one render is capped at this multiple.
_PRODUCED_FACTOR = 4

# Used for models whose GGUF has no tokenizer.chat_template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Strings that end an assistant turn in common template families, as the engine's stop list.
_END_OF_TURN_MARKERS = (
    "<|im_end|>",  # ChatML (Qwen, SmolLM, ...)
    "<|eot_id|>",  # Llama 3
    "<|eom_id|>",  # Llama 3 tool calls
    "<end_of_turn>",  # Gemma
    "<|end|>",  # Phi-3, gpt-oss
    "<|return|>",  # gpt-oss
    "<|END_OF_TURN_TOKEN|>",  # Command-R
    "<|end_of_text|>",
    "<|endoftext|>",
    "<｜end▁of▁sentence｜>",  # DeepSeek
)


class ChatTemplateError(ValueError):
    """The chat template could not be compiled or rendered."""


NO_TEMPLATE_MESSAGE = (
    "this model has no chat template (a base model): use /v1/completions, or give the server "
    "one with `inferd serve --chat-template FILE` (chat_template in a --config file)"
)


class NoChatTemplateError(ChatTemplateError):
    """The model brings no chat template and none was given: chat is refused."""

    def __init__(self) -> None:
        super().__init__(NO_TEMPLATE_MESSAGE)


# --- limits --------------------------------------------------------------------------------------


@dataclass
class _Budget:
    """Limits of the render in progress, read by the environment's hooks."""

    max_size: int
    deadline: float
    ticks: int = 0
    produced: int = 0


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("_BUDGET", default=None)


def _max_size() -> int:
    budget = _BUDGET.get()
    return MAX_OUTPUT_CHARS if budget is None else budget.max_size


def _too_big(what: str, size: int) -> ChatTemplateError:
    return ChatTemplateError(
        f"chat template exceeded the size limit: {what} would be {size} > {_max_size()}"
    )


def _check_size(what: str, size: int) -> None:
    if size > _max_size():
        raise _too_big(what, size)


def _namespace_attrs(ns: Namespace) -> dict[str, Any]:
    attrs: dict[str, Any] = object.__getattribute__(ns, "_Namespace__attrs")
    return attrs


def _children(value: Any) -> Iterable[Any] | None:
    if isinstance(value, list | tuple | set | frozenset):
        return value
    if isinstance(value, dict):
        return [*value.keys(), *value.values()]
    if isinstance(value, Namespace):
        return list(_namespace_attrs(value).values())
    return None


def _expanded_size(value: Any, limit: int | None = None) -> int:
    """Characters + elements that ``str()`` or ``json.dumps`` would expand ``value`` into.

    Shared sub-structures count at every occurrence (``[x, x]`` costs twice ``x``), which is
    what makes the count an honest bound. Stops early once past ``limit``.
    """
    limit = _max_size() if limit is None else limit
    memo: dict[int, int] = {}
    active: set[int] = set()

    def visit(v: Any, depth: int) -> int:
        if isinstance(v, str | bytes):
            return len(v) + 1
        if isinstance(v, int):
            return 1 + v.bit_length() // 64
        children = _children(v)
        if children is None:
            return 1
        key = id(v)
        if key in memo:
            return memo[key]
        if key in active:  # a cycle: str() prints it as [...]
            return 1
        if depth > _MAX_NESTING:
            raise ChatTemplateError(f"chat template value nested deeper than {_MAX_NESTING}")
        active.add(key)
        total = 1
        for child in children:
            total += visit(child, depth + 1)
            if total > limit:
                raise _too_big(f"a {type(v).__name__}", total)
        active.discard(key)
        memo[key] = total
        return total

    size = visit(value, 0)
    if size > limit:
        raise _too_big(f"a {type(value).__name__}", size)
    return size


def _bounded(value: Any) -> Any:
    _expanded_size(value)
    return value


# --- format strings -------------------------------------------------------------------------------

_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_printf(fmt: str | bytes) -> None:
    """Refuse %-format strings whose widths/precisions would pad beyond the size limit."""
    text = fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt
    padding = 0
    for m in _PRINTF_SPEC.finditer(text):
        for number in m.groups():
            if number == "*":
                raise ChatTemplateError("chat template: '*' widths in %-formatting are not allowed")
            if number:
                padding += int(number)
    _check_size("%-format padding", padding)


def _check_str_format(fmt: str) -> None:
    """Same for ``str.format``: nested replacement fields in a spec are refused outright."""
    padding = 0
    try:
        parsed = list(string.Formatter().parse(fmt))
    except ValueError as e:
        raise ChatTemplateError(f"chat template: bad format string: {e}") from e
    for _, _, spec, _ in parsed:
        if spec and "{" in spec:
            raise ChatTemplateError("chat template: nested format specs are not allowed")
        padding += sum(int(n) for n in re.findall(r"\d+", spec or ""))
    _check_size("str.format padding", padding)


# --- binary operators and method calls ----------------------------------------------------------


def _check_binop(operator: str, left: Any, right: Any) -> None:
    sequence = str | bytes | list | tuple
    if operator == "**" and isinstance(left, int) and isinstance(right, int):
        if right > 0 and abs(left) > 1 and right * left.bit_length() > _MAX_INT_BITS:
            raise ChatTemplateError(f"chat template: integer power too large ({left}**{right})")
    elif operator == "*":
        both_int = isinstance(left, int) and isinstance(right, int)
        if both_int and left.bit_length() + right.bit_length() > _MAX_INT_BITS:
            raise ChatTemplateError("chat template: integer product too large")
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, sequence) and isinstance(n, int) and n > 0:
                _check_size(f"{type(seq).__name__} * {n}", n * _expanded_size(seq))
    elif operator == "+" and isinstance(left, sequence) and isinstance(right, sequence):
        _check_size("concatenation", _expanded_size(left) + _expanded_size(right))
    elif operator == "%" and isinstance(left, str | bytes):
        _check_printf(left)


def _int_arg(args: Sequence[Any], kwargs: Mapping[str, Any], index: int, name: str) -> int:
    value = args[index] if len(args) > index else kwargs.get(name, 0)
    return value if isinstance(value, int) else 0


def _replace_size(s: str | bytes, old: Any, new: Any, count: Any) -> int:
    if not isinstance(old, str | bytes) or not isinstance(new, str | bytes):
        return len(s)
    hits = s.count(old) if old else len(s) + 1  # type: ignore[arg-type]
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * len(new)


def _check_string_method(
    receiver: str | bytes, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, ...]:
    """Pre-check str/bytes methods that can amplify; returns args (join's input materialized)."""
    if name in ("ljust", "rjust", "center", "zfill"):
        _check_size(f"str.{name}", _int_arg(args, kwargs, 0, "width"))
    elif name == "expandtabs":
        tabsize = _int_arg(args, kwargs, 0, "tabsize") or 8
        tabs = receiver.count("\t" if isinstance(receiver, str) else b"\t")  # type: ignore[arg-type]
        _check_size("str.expandtabs", len(receiver) + tabs * tabsize)
    elif name == "replace" and len(args) >= 2:
        count = args[2] if len(args) > 2 else kwargs.get("count", -1)
        _check_size("str.replace", _replace_size(receiver, args[0], args[1], count))
    elif name == "join" and args:
        items = list(args[0])
        _check_size("str.join", len(receiver) * len(items) + _expanded_size(items))
        return (items, *args[1:])
    elif name in ("translate", "maketrans"):
        raise ChatTemplateError(f"chat template: str.{name} is not allowed")
    return args


# --- filters and globals -------------------------------------------------------------------------


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """HF's ``tojson``: plain JSON (no HTML escaping), non-ASCII kept, optional indent."""
    width = len(indent) if isinstance(indent, str) else (indent or 0)
    if width > _MAX_JSON_INDENT:
        raise ChatTemplateError(f"chat template: tojson indent {width} > {_MAX_JSON_INDENT}")
    if separators is not None and any(len(s) > _MAX_JSON_INDENT for s in separators):
        raise ChatTemplateError("chat template: tojson separators too long")
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: Any) -> None:
    raise ChatTemplateError(f"chat template raised an exception: {message}")


def _strftime_now(fmt: str) -> str:
    if len(fmt) > _MAX_STRFTIME_FORMAT:
        raise ChatTemplateError("chat template: strftime_now format too long")
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict`` for templates without exposing the ``dict`` type object itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, keys: Iterable[Any], value: Any = None) -> dict[Any, Any]:
        return dict.fromkeys(keys, value)


class _TemplateNamespace(Namespace):
    """``namespace`` refusing underscore names, which could reach ``_Namespace__attrs``."""

    # No named ``self``, like Namespace: a template may pass ``namespace(self=...)``.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"namespace attribute {name!r} starts with an underscore")


def _filter_prechecks(name: str, a: Mapping[str, Any]) -> dict[str, Any]:
    """Bound the result of amplifying filters from their arguments, before they run.

    ``a`` holds the filter's bound arguments by parameter name; returns replacements.
    """
    if name == "center":
        _check_size("center", _int_arg((), a, 0, "width"))
    elif name == "indent":
        s, width = str(a.get("s", "")), a.get("width", 4)
        per_line = len(width) if isinstance(width, str) else (width or 0)
        _check_size("indent", len(s) + (s.count("\n") + 1) * per_line)
    elif name == "join":
        items = list(a["value"])
        _check_size("join", len(str(a.get("d", ""))) * len(items) + _expanded_size(items))
        return {"value": items}
    elif name == "replace":
        s = a.get("s", "")
        if isinstance(s, str):
            _check_size("replace", _replace_size(s, a.get("old"), a.get("new"), a.get("count")))
    elif name == "format":
        _check_printf(str(a.get("value", "")))
    elif name in ("batch", "slice"):
        n = a.get("linecount" if name == "batch" else "slices", 0)
        n = n if isinstance(n, int) else 0
        _check_size(name, n * (1 + _expanded_size(a.get("fill_with"))))
    elif name == "wordwrap":
        wrap = a.get("wrapstring") or "\n"
        _check_size("wordwrap", len(str(a.get("s", ""))) * (len(wrap) + 1))
    elif name == "sum" and not isinstance(a.get("start", 0), int | float):
        # Summing sequences is quadratic inside C; no chat template needs it.
        raise ChatTemplateError("chat template: sum() only adds numbers")
    return {}


def _bind(
    signature: inspect.Signature | None, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> inspect.BoundArguments | None:
    if signature is None:
        return None
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return bound


def _guard_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a filter with its pre-check and a size check of its result.

    ``functools.wraps`` keeps Jinja's pass-context marker, so the filter is called as before.
    """
    try:
        signature: inspect.Signature | None = inspect.signature(func)
    except (TypeError, ValueError):  # a builtin without introspectable parameters
        signature = None

    @functools.wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        bound = _bind(signature, args, kwargs)
        if bound is None:  # let the filter report its own misuse
            return _bounded(func(*args, **kwargs))
        replaced = _filter_prechecks(name, bound.arguments)
        if replaced:
            bound.arguments.update(replaced)
        return _bounded(func(*bound.args, **bound.kwargs))

    return guarded


# --- the environment -----------------------------------------------------------------------------


class _BoundedCodeGenerator(CodeGenerator):
    """Route constructs the sandbox cannot intercept through ``environment.bounded``.

    List/tuple/dict literals can nest shared references (``[x, x]``) and ``~`` concatenates;
    repeated in a loop, either doubles a value's expanded size each time.
    """

    def _wrapped(self, visit: Callable[[], None]) -> None:
        self.write("environment.bounded(")
        visit()
        self.write(")")

    def visit_List(self, node: nodes.List, frame: Frame) -> None:
        self._wrapped(lambda: super(_BoundedCodeGenerator, self).visit_List(node, frame))

    def visit_Dict(self, node: nodes.Dict, frame: Frame) -> None:
        self._wrapped(lambda: super(_BoundedCodeGenerator, self).visit_Dict(node, frame))

    def visit_Tuple(self, node: nodes.Tuple, frame: Frame) -> None:
        if node.ctx != "load":  # assignment targets must stay plain tuples
            super().visit_Tuple(node, frame)
            return
        self._wrapped(lambda: super(_BoundedCodeGenerator, self).visit_Tuple(node, frame))

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self._wrapped(lambda: super(_BoundedCodeGenerator, self).visit_Concat(node, frame))

    # Every {{ ... }} result passes through ``environment.produced``, buffered or not.
    def _output_child_pre(self, node: nodes.Expr, frame: Frame, finalize: Any) -> None:
        self.write("environment.produced(")
        super()._output_child_pre(node, frame, finalize)

    def _output_child_post(self, node: nodes.Expr, frame: Frame, finalize: Any) -> None:
        super()._output_child_post(node, frame, finalize)
        self.write(")")


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}``: HF marks assistant text; we just render it."""

    tags = {"generation"}  # noqa: RUF012 - Jinja's Extension API declares it this way

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        body: list[nodes.Node] = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return body


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"+", "*", "**", "%"})
    code_generator_class = _BoundedCodeGenerator

    def unsafe_undefined(self, obj: Any, attribute: str) -> Undefined:
        # Jinja returns an Undefined that only fails when used, so ``{{ x.__globals__ }}``
        # would quietly render "". A template that reaches for internals is hostile: stop it.
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return _bounded(super().call_binop(context, operator, left, right))

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        receiver = getattr(__obj, "__self__", None)
        if isinstance(receiver, str | bytes):
            args = _check_string_method(receiver, getattr(__obj, "__name__", ""), args, kwargs)
        return _bounded(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        fmt = value.__self__

        def checked(*args: Any, **kwargs: Any) -> str:
            _check_str_format(fmt)
            return str(_bounded(wrapper(*args, **kwargs)))

        return checked

    def concat(self, parts: Iterable[str]) -> str:
        """Join a block's output (``{% set %}`` blocks, macros) only if the result fits."""
        chunks = list(parts)
        _check_size("block output", sum(len(c) for c in chunks))
        return "".join(chunks)

    @staticmethod
    def bounded(value: Any) -> Any:
        return _bounded(value)

    @staticmethod
    def produced(text: str) -> str:
        budget = _BUDGET.get()
        if budget is not None:
            budget.produced += len(text)
            if budget.produced > _PRODUCED_FACTOR * budget.max_size:
                raise ChatTemplateError(
                    f"chat template produced more than {_PRODUCED_FACTOR} x "
                    f"{budget.max_size} characters of output"
                )
        return text


def _make_environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.filters = {name: _guard_filter(name, f) for name, f in env.filters.items()}
    env.globals.pop("lipsum", None)  # text generator no chat template uses
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_TemplateDict(),
        namespace=_TemplateNamespace,
    )
    return env


_ENV = _make_environment()
_TEMPLATE_FILENAME = "<template>"  # what Jinja names code compiled by from_string()


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> Any:
    if len(source) > _MAX_SOURCE_CHARS:
        raise ChatTemplateError(f"chat template is {len(source)} chars, limit {_MAX_SOURCE_CHARS}")
    try:
        return _ENV.from_string(source)
    except TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"chat template syntax error at line {e.lineno}: {e.message}"
        ) from e
    except (TemplateError, RecursionError, MemoryError) as e:
        raise ChatTemplateError(f"chat template failed to compile: {e}") from e


# --- time limit ----------------------------------------------------------------------------------


class _RenderTimeout(BaseException):
    """Raised from the trace function. A BaseException, so no ``except Exception`` swallows it."""


def _tracer(budget: _Budget) -> Callable[[FrameType, str, Any], Any]:
    """A ``sys.settrace`` function that aborts the render once past the deadline.

    Jinja templates compile to Python, and a hostile one can loop for hours (nested loops over
    ``range(100000)``); tracing is the only way to interrupt pure-Python work in this thread.
    Every function call is checked, but only template code is traced line by line (its loops
    may call nothing), and the clock is read every 64 events: this keeps the overhead small.
    """

    def check(frame: FrameType, event: str, arg: Any) -> Any:
        budget.ticks += 1
        if budget.ticks & 63 == 0 and time.monotonic() > budget.deadline:
            raise _RenderTimeout
        return check

    def on_call(frame: FrameType, event: str, arg: Any) -> Any:
        check(frame, event, arg)
        return check if frame.f_code.co_filename == _TEMPLATE_FILENAME else None

    return on_call


# --- public API ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RenderedChat:
    """A rendered conversation and the [start, end) spans of special-token text in it that came
    from the messages rather than from the template."""

    text: str
    literal_spans: tuple[tuple[int, int], ...] = ()

    def __add__(self, tail: RenderedChat) -> RenderedChat:
        shift = len(self.text)
        spans = [(a + shift, b + shift) for a, b in tail.literal_spans]
        return RenderedChat(self.text + tail.text, (*self.literal_spans, *spans))


def literal_text(text: str, special: re.Pattern[str] | None) -> RenderedChat:
    """``text`` from a message, appended to a prompt as is (a prefill): all of it is literal."""
    if special is None:
        return RenderedChat(text)
    return RenderedChat(text, tuple(m.span() for m in special.finditer(text)))


def _holds_special(special: re.Pattern[str], value: Any) -> bool:
    """Whether any string in ``value``, however deep, holds special-token text."""
    if isinstance(value, str):
        return special.search(value) is not None
    if isinstance(value, Mapping):
        return any(_holds_special(special, v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_holds_special(special, v) for v in value)
    return False


class _Defused:
    """Swaps special-token text in message strings for markers that carry no special token,
    and back after rendering, noting where each landed.

    A marker is a noncharacter pair around a per-render random number and an index, so a
    message cannot predict (or forge) one.
    """

    def __init__(self, special: re.Pattern[str]) -> None:
        self.special = special
        self.nonce = secrets.randbelow(10**12)
        self.found: list[str] = []
        self.marker = re.compile(f"\ufdd0{self.nonce}:(\\d+)\ufdd1")

    def message(self, message: Mapping[str, Any]) -> dict[str, Any]:
        return {k: self.value(v) if k != "role" else v for k, v in message.items()}

    def value(self, value: Any) -> Any:
        """``value`` with its strings defused, however deep (tool calls, tool schemas)."""
        if isinstance(value, str):
            return self.special.sub(self._swap, value)
        if isinstance(value, Mapping):
            return {k: self.value(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.value(v) for v in value]
        return value

    def _swap(self, match: re.Match[str]) -> str:
        self.found.append(match.group())
        return f"\ufdd0{self.nonce}:{len(self.found) - 1}\ufdd1"

    def restore(self, text: str) -> RenderedChat:
        parts: list[str] = []
        spans: list[tuple[int, int]] = []
        size = last = 0
        for m in self.marker.finditer(text):
            parts.append(text[last : m.start()])
            size += m.start() - last
            original = self.found[int(m.group(1))]
            parts.append(original)
            spans.append((size, size + len(original)))
            size += len(original)
            last = m.end()
        parts.append(text[last:])
        return RenderedChat("".join(parts), tuple(spans))


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template; ``render`` turns a conversation into the prompt text."""

    source: str
    bos_token: str = ""
    eos_token: str = ""
    max_output_chars: int = field(default=MAX_OUTPUT_CHARS, repr=False)
    timeout_s: float = field(default=RENDER_TIMEOUT_S, repr=False)
    # The model file has no template: ``source`` is ChatML only for tools that read it (convert),
    # and rendering refuses, since guessing a format a base model never saw yields nonsense.
    missing: bool = False

    def __post_init__(self) -> None:
        _compile(self.source)  # fail at load time, not at the first request

    @classmethod
    def from_metadata(
        cls, metadata: Mapping[str, Any], *, bos_token: str | None, eos_token: str | None
    ) -> ChatTemplate:
        """The GGUF's ``tokenizer.chat_template``; when the file has none, a ``missing`` one
        (rendering it raises ``NoChatTemplateError``)."""
        source = metadata.get("tokenizer.chat_template")
        missing = not isinstance(source, str) or not source.strip()
        return cls(
            source=CHATML_TEMPLATE if missing else str(source),
            bos_token=bos_token or "",
            eos_token=eos_token or "",
            missing=missing,
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """Render like HF's ``apply_chat_template(..., tokenize=False)``.

        ``extra`` becomes template variables (``tools``, ``documents``, ...) and may override
        ``bos_token`` / ``eos_token``.
        """
        if self.missing:
            raise NoChatTemplateError()
        template = _compile(self.source)
        context: dict[str, Any] = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        context.update(extra)
        context["messages"] = [dict(m) for m in messages]
        context["add_generation_prompt"] = add_generation_prompt
        budget = _Budget(self.max_output_chars, time.monotonic() + self.timeout_s)
        token = _BUDGET.set(budget)
        previous_trace = sys.gettrace()
        sys.settrace(_tracer(budget))
        try:
            return self._stream(template, context)
        except ChatTemplateError:
            raise
        except _RenderTimeout:
            raise ChatTemplateError(
                f"chat template took longer than {self.timeout_s}s to render"
            ) from None
        except SecurityError as e:
            raise ChatTemplateError(f"chat template sandbox violation: {e}") from e
        except TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from e
        except (RecursionError, MemoryError) as e:
            raise ChatTemplateError(f"chat template ran out of resources: {e!r}") from e
        except Exception as e:
            raise ChatTemplateError(
                f"chat template failed to render: {type(e).__name__}: {e}"
            ) from e
        finally:
            sys.settrace(previous_trace)
            _BUDGET.reset(token)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        special: re.Pattern[str] | None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> RenderedChat:
        """``render``, noting where special-token text from the messages or the ``tools``
        (``special`` matches it) ended up. A conversation that has none renders exactly as
        ``render`` would. ``tools``: the template's ``tools`` variable, when given;
        ``variables``: more template variables (``enable_thinking``, ...)."""
        extra = dict(variables or {}) | ({} if tools is None else {"tools": tools})
        if special is None or not _holds_special(special, [messages, tools]):
            text = self.render(messages, add_generation_prompt=add_generation_prompt, **extra)
            return RenderedChat(text)
        defused = _Defused(special)
        if tools is not None:
            extra["tools"] = defused.value(tools)
        text = self.render(
            [defused.message(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            **extra,
        )
        return defused.restore(text)

    def _stream(self, template: Any, context: dict[str, Any]) -> str:
        parts: list[str] = []
        total = 0
        chunks = template.generate(context)
        try:
            for chunk in chunks:
                total += len(chunk)
                if total > self.max_output_chars:
                    raise ChatTemplateError(
                        f"chat template output exceeds {self.max_output_chars} characters"
                    )
                parts.append(chunk)
        finally:
            chunks.close()
        return "".join(parts)

    def end_of_turn_tokens(self) -> tuple[str, ...]:
        """Special-token strings in the template that end a turn, in order of appearance.

        The engine adds these to its stop list. ``eos_token`` is included when the template
        writes it (Llama 2 / Mistral style ``... {{ eos_token }}``).
        """
        found = {m: self.source.find(m) for m in _END_OF_TURN_MARKERS if m in self.source}
        if self.eos_token and self.eos_token not in found:
            position = self.source.find("eos_token")
            if position >= 0:
                found[self.eos_token] = position
        return tuple(sorted(found, key=lambda m: found[m]))
