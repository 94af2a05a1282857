"""Request models of the OpenAI chat API. Unknown fields are ignored, as OpenAI clients expect.

Parsing goes through ``parse_body`` so every failure becomes a 400 naming the parameter. The
JSON itself is read by ``load_json`` with explicit bounds, because Python's decoder has none of
its own that fail cleanly: nesting past the recursion limit raises RecursionError, an integer of
more than 4,300 digits raises ValueError, a lone surrogate escape (``"\\ud800"``) decodes into a
string that cannot be encoded again, and ``NaN`` / ``Infinity`` are accepted though JSON has
neither. Types are strict, as OpenAI's and Anthropic's APIs are: ``"10"`` is not an integer and
``"yes"`` is not a boolean (``8.0`` is an integer, as in JSON Schema: ``WholeInt``). Fields the
OpenAI spec marks nullable take ``null`` as "the default".
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from inferd.server.errors import APIError, bad_request

ROLES = ("system", "developer", "user", "assistant", "tool")


MAX_JSON_DEPTH = 64  # arrays and objects inside each other; real requests use under 10
MAX_NUMBER_CHARS = 100  # characters of one JSON number; a 64-bit seed has 20

# A \\u escape of a UTF-16 surrogate; the decoder pairs them, but a lone one stays in the string.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def whole_number(value: Any) -> Any:
    """A number with a zero fraction (``8412.0``) as the integer it is: JSON Schema's
    ``integer``, which both APIs' specs use, takes it. ``1.5`` stays a float, which the strict
    integer check refuses."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# An integer field of a request: an int, or a float with nothing after the point.
WholeInt = Annotated[int, BeforeValidator(whole_number)]


class _Lenient(BaseModel):
    """Unknown fields ignored, known ones type-checked strictly (no "10" for 10)."""

    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Lenient):
    include_usage: bool = False


class ChatMessage(_Lenient):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # an assistant turn's calls (server/openai_tools.py)
    tool_call_id: str | None = None  # the call a tool turn answers

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
        return role


class SamplingFields(_Lenient):
    """Fields chat and text completions share."""

    model: str | None = None
    max_tokens: WholeInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: WholeInt | None = None
    min_p: float | None = None
    seed: WholeInt | None = None
    stop: str | list[str] | None = None
    n: WholeInt | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = None
    user: str | None = None
    # The output's constraint (server/constraints.py): OpenAI's response_format, or one of
    # inferd's extensions.
    response_format: dict[str, Any] | None = None
    regex: str | None = None  # the whole output matches this regular expression
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # a Lark or GBNF grammar the output follows


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # more chat template variables (vLLM's name): {"enable_thinking": false} for Qwen3
    chat_template_kwargs: dict[str, Any] | None = None
    max_completion_tokens: WholeInt | None = None
    logprobs: bool | None = None
    top_logprobs: WholeInt | None = None
    metadata: dict[str, Any] | None = None
    tools: list[Any] | None = None  # checked by server/openai_tools.py
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # inferd's agent loop (server/agent_loop.py): 0 rounds runs none of the server's tools
    max_tool_rounds: WholeInt | None = None
    enable_code_execution: bool | None = None
    agent_progress: bool | None = None  # the loop's agent_* events in the stream
    session_id: str | None = None  # a conversation the server keeps (server/agent_sessions.py)
    # Known to OpenAI, not supported here: a request that uses one gets a 400 naming it.
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None


class CompletionRequest(SamplingFields):
    # str | list[str] | list[int] | list[list[int]], checked by the route for clear messages
    prompt: Any = None
    echo: bool | None = None
    logprobs: WholeInt | None = None
    suffix: str | None = None
    best_of: WholeInt | None = None


M = TypeVar("M", bound=BaseModel)


def parse_body(raw: bytes, model: type[M]) -> M:
    data = load_json(raw)
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _from_validation(exc) from None


def load_json(raw: bytes) -> Any:
    """The JSON value of a request body, or a 400 (code ``invalid_json``) saying what is wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _invalid(f"it is not UTF-8 (byte {exc.start})") from None
    try:
        data = json.loads(
            text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_no_constant
        )
    except json.JSONDecodeError as exc:
        raise _invalid(str(exc)) from None
    except RecursionError:
        raise _invalid(f"arrays and objects are nested deeper than {MAX_JSON_DEPTH}") from None
    _check_structure(data, strings=_SURROGATE_ESCAPE.search(raw) is not None)
    return data


def _parse_int(digits: str) -> int:
    _check_number(digits)
    return int(digits)


def _parse_float(digits: str) -> float:
    _check_number(digits)
    return float(digits)


def _check_number(digits: str) -> None:
    if len(digits) > MAX_NUMBER_CHARS:
        raise _invalid(
            f"a number is {len(digits)} characters long; the limit is {MAX_NUMBER_CHARS}"
        )


def _no_constant(name: str) -> Any:
    raise _invalid(f"{name} is not a JSON value")


def _check_structure(data: Any, *, strings: bool) -> None:
    """Nesting depth, and (``strings``: the body escapes a surrogate) that every string is
    valid Unicode; one walk over the containers, without recursion."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Any = value.values()
            if strings:
                for key in value:
                    _check_string(key)
        elif isinstance(value, list):
            children = value
        else:
            if strings and isinstance(value, str):
                _check_string(value)
            continue
        if depth > MAX_JSON_DEPTH:
            raise _invalid(f"arrays and objects are nested deeper than {MAX_JSON_DEPTH}")
        for child in children:
            if isinstance(child, dict | list) or (strings and isinstance(child, str)):
                stack.append((child, depth + 1))


def _check_string(value: str) -> None:
    if (m := _SURROGATE.search(value)) is not None:
        raise _invalid(
            f"a string holds the lone surrogate \\u{ord(m.group()):04x}, which is not Unicode text"
        )


def _invalid(why: str) -> APIError:
    return bad_request(f"the request body is not valid JSON: {why}", code="invalid_json")


def _from_validation(exc: ValidationError) -> APIError:
    first = exc.errors()[0]
    loc = [str(p) for p in first["loc"] if not _is_union_tag(str(p))]
    param = ".".join(loc) or None
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        message = "is required"
    elif first["type"] == "too_short" and param == "messages":
        message = "must contain at least one message"
    return bad_request(f"{param}: {message}" if param else message, param=param)


def _is_union_tag(part: str) -> bool:
    """pydantic names the member of a union that failed in ``loc`` ("str", "list[str]"); field
    names never contain brackets and none is a bare type name."""
    return "[" in part or part in ("str", "int", "float", "bool")
