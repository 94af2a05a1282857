"""The output constraint a chat or text completion asks for, compiled before it is admitted.

OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``) and inferd's
extensions ``regex``, ``choice`` (one of a list of strings) and ``grammar`` (Lark or GBNF):
at most one per request. The constraint is compiled off the event loop, bounded in time
(structured/compiler.py), so a schema that does not compile is a 400 naming its problem before
any engine work starts, and a hostile one never stalls other requests.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import replace
from typing import Any

from inferd.server.errors import bad_request
from inferd.server.protocol import SamplingFields
from inferd.serving.interface import SamplingParams
from inferd.serving.served import ServedModel
from inferd.structured.constraint import Constraint, ConstraintError, ConstraintKind

_SCHEMA_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_EXTENSIONS = ("regex", "choice", "grammar")
_JSON_KINDS = (ConstraintKind.JSON_OBJECT, ConstraintKind.JSON_SCHEMA)
# The request field a compile error is about.
_FIELDS = {
    ConstraintKind.JSON_OBJECT: "response_format",
    ConstraintKind.JSON_SCHEMA: "response_format.json_schema.schema",
    ConstraintKind.REGEX: "regex",
    ConstraintKind.CHOICE: "choice",
    ConstraintKind.GRAMMAR: "grammar",
    ConstraintKind.LARK: "tools",
}


async def checked_constraint(
    body: SamplingFields, tools: Constraint | None = None
) -> Constraint | None:
    """The request's constraint, its fields checked (a cheap step, before any media is fetched
    or any prompt rendered); ``compiled`` builds its grammar later."""
    # A schema's checks walk all of it in Python: a large one would hold the event loop (and
    # every stream's tokens) for a while, so it is checked on a worker thread.
    constraint = await asyncio.to_thread(request_constraint, body)
    if tools is None:
        return constraint
    # response_format is already inside ``tools`` (see answer_schema); the extensions have no
    # JSON form a tool call could sit beside.
    if constraint is not None and constraint.kind not in _JSON_KINDS:
        raise bad_request(
            "tools with a tool_choice other than none cannot be combined with "
            "regex, choice or grammar",
            "tool_choice",
        )
    return tools


async def compiled(
    model: ServedModel,
    params: SamplingParams,
    constraint: Constraint | None,
    param: str | None = None,
) -> SamplingParams:
    """``params`` with ``constraint`` compiled for ``model`` (off the event loop, bounded).
    ``param``: the request field its errors name (by default, the one its kind comes from)."""
    if constraint is None:
        return params
    grammars = model.engine.grammars
    if grammars is None:
        message = "this model does not support constrained output"
        raise bad_request(f"{param}: {message}" if param else message, param or "response_format")
    field = param or _FIELDS[constraint.kind]
    try:
        await grammars.prepare(constraint)
    except ConstraintError as exc:
        raise bad_request(f"{field}: {exc}", field) from None
    return replace(params, constraint=constraint)


def answer_schema(body: SamplingFields) -> Any:
    """The JSON schema ``response_format`` holds a text reply to, or None: tool use beside it
    (chat) lets the model either call a tool or answer in that shape."""
    fmt = _response_format(body.response_format)
    if fmt is None:
        return None
    if fmt.kind is ConstraintKind.JSON_OBJECT:
        return {"type": "object"}
    return json.loads(fmt.source)


def request_constraint(body: SamplingFields) -> Constraint | None:
    """The one constraint of a request, or None; a 400 naming the field when it is invalid."""
    given = [name for name in _EXTENSIONS if getattr(body, name) is not None]
    fmt = _response_format(body.response_format)
    if fmt is not None:
        given.insert(0, "response_format")
    if len(given) > 1:
        raise bad_request(
            f"{' and '.join(given)}: a request may constrain its output one way only",
            given[1],
        )
    try:
        if fmt is not None:
            return fmt
        if body.regex is not None:
            return Constraint.regex(body.regex)
        if body.choice is not None:
            return Constraint.choice(body.choice)
        if body.grammar is not None:
            return Constraint.grammar(body.grammar)
    except ConstraintError as exc:
        raise _bad(exc) from None
    return None


def _response_format(value: dict[str, Any] | None) -> Constraint | None:
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object()
    if kind != "json_schema":
        raise bad_request(
            f"response_format: unknown type {kind!r}; expected text, json_object or json_schema",
            "response_format.type",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request(
            "response_format.json_schema is required for type json_schema: an object with "
            "name, schema and strict",
            "response_format.json_schema",
        )
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise bad_request(
            "response_format.json_schema.name must be 1 to 64 letters, digits, _ or -",
            "response_format.json_schema.name",
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(
            "response_format.json_schema.strict must be a boolean",
            "response_format.json_schema.strict",
        )
    # Strict or not, the output is held to the schema: decoding is always constrained.
    try:
        return Constraint.json_schema(
            spec.get("schema", {}), param="response_format.json_schema.schema"
        )
    except ConstraintError as exc:
        raise _bad(exc) from None


def _bad(exc: ConstraintError) -> Exception:
    param = exc.param or "response_format"
    if param == "schema":
        param = "response_format.json_schema.schema"
    return bad_request(f"{param}: {exc}", param)
