"""Refuse JSON schemas we will not compile, with a message that names the problem and where.

llguidance ignores keywords it does not know (as JSON Schema allows), so a misspelt
``"proprties"`` would silently constrain nothing: we refuse unknown keywords instead (``x-``
extensions aside). We also bound what could make compilation or matching blow up (nesting
depth, enum values, property count) and refuse ``$ref`` cycles that never consume input
(``a -> b -> a`` through ``$ref``/``allOf``/``anyOf``/``oneOf``), whose language is empty.
Recursion through ``properties`` or ``items`` (a tree) is fine and stays allowed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from inferd.structured.errors import ConstraintError

MAX_DEPTH = 16  # nested subschemas (OpenAI allows 10 levels in strict mode)
MAX_ENUM_VALUES = 1000  # enum entries, over the whole schema
MAX_PROPERTIES = 5000  # property definitions, over the whole schema

_SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)
_SCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})
_SCHEMA_ONE = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "contains",
        "additionalProperties",
        "propertyNames",
        "unevaluatedItems",
        "unevaluatedProperties",
        "additionalItems",
        "contentSchema",
        "items",  # a list too, in draft 7 (tuples)
    }
)
_VALUES = frozenset(
    {
        "$schema", "$id", "$ref", "$comment", "$anchor", "$dynamicRef", "$dynamicAnchor",
        "$vocabulary", "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum",
        "minimum", "exclusiveMinimum", "maxLength", "minLength", "pattern", "maxItems",
        "minItems", "uniqueItems", "maxContains", "minContains", "maxProperties",
        "minProperties", "required", "dependentRequired", "dependencies", "title",
        "description", "default", "deprecated", "readOnly", "writeOnly", "examples", "format",
        "contentEncoding", "contentMediaType", "discriminator", "nullable",
    }
)  # fmt: skip
KNOWN_KEYWORDS = _SCHEMA_MAPS | _SCHEMA_LISTS | _SCHEMA_ONE | _VALUES
_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
# Subschema positions that consume no input: a cycle through only these never ends.
_PASS_THROUGH = ("allOf", "anyOf", "oneOf")


@dataclass(slots=True)
class _Walk:
    param: str
    enum_values: int = 0
    properties: int = 0
    # pointer of every subschema -> the $ref targets it reaches without consuming input
    refs: dict[str, list[str]] = field(default_factory=dict)


def check_schema(schema: Any, param: str = "schema") -> None:
    """ConstraintError naming the first problem of ``schema`` (and its JSON pointer)."""
    walk = _Walk(param)
    _check(schema, "#", 0, walk)
    _check_ref_cycles(walk)


def _check(schema: Any, where: str, depth: int, walk: _Walk) -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, Mapping):
        raise ConstraintError(
            f"the subschema at {where} must be an object or a boolean", walk.param
        )
    if depth > MAX_DEPTH:
        raise ConstraintError(
            f"the schema nests deeper than {MAX_DEPTH} levels (at {where})", walk.param
        )
    for key in schema:
        if key not in KNOWN_KEYWORDS and not str(key).startswith("x-"):
            raise ConstraintError(f"unknown keyword {key!r} at {where}", walk.param)
    _check_values(schema, where, walk)
    walk.refs[where] = list(_pass_through_refs(schema))
    for key, child_where, child in _subschemas(schema, where, walk):
        del key
        _check(child, child_where, depth + 1, walk)


def _check_values(schema: Mapping[str, Any], where: str, walk: _Walk) -> None:
    types = schema.get("type")
    for t in types if isinstance(types, list) else [types] if types is not None else []:
        if not isinstance(t, str) or t not in _TYPES:
            raise ConstraintError(f"unknown type {t!r} at {where}", walk.param)
    enum = schema.get("enum")
    if enum is not None:
        if not isinstance(enum, list) or not enum:
            raise ConstraintError(f"enum at {where} must be a non-empty array", walk.param)
        walk.enum_values += len(enum)
        if walk.enum_values > MAX_ENUM_VALUES:
            raise ConstraintError(
                f"the schema's enums hold more than {MAX_ENUM_VALUES} values (at {where})",
                walk.param,
            )
    ref = schema.get("$ref")
    if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
        raise ConstraintError(
            f"$ref {ref!r} at {where}: only references inside the schema (#/...) are supported",
            walk.param,
        )
    required = schema.get("required")
    if required is not None and not (
        isinstance(required, list) and all(isinstance(r, str) for r in required)
    ):
        raise ConstraintError(f"required at {where} must be an array of strings", walk.param)


def _subschemas(
    schema: Mapping[str, Any], where: str, walk: _Walk
) -> Iterator[tuple[str, str, Any]]:
    for key, value in schema.items():
        if key in _SCHEMA_MAPS:
            if not isinstance(value, Mapping):
                raise ConstraintError(f"{key} at {where} must be an object", walk.param)
            if key == "properties":
                walk.properties += len(value)
                if walk.properties > MAX_PROPERTIES:
                    raise ConstraintError(
                        f"the schema defines more than {MAX_PROPERTIES} properties", walk.param
                    )
            for name, child in value.items():
                yield key, f"{where}/{key}/{_escape(name)}", child
        elif key in _SCHEMA_LISTS or (key == "items" and isinstance(value, list)):
            if not isinstance(value, list):
                raise ConstraintError(f"{key} at {where} must be an array", walk.param)
            for i, child in enumerate(value):
                yield key, f"{where}/{key}/{i}", child
        elif key in _SCHEMA_ONE:
            yield key, f"{where}/{key}", value


def _pass_through_refs(schema: Mapping[str, Any]) -> Iterator[str]:
    """$ref targets reached from ``schema`` without consuming any input."""
    ref = schema.get("$ref")
    if isinstance(ref, str):
        yield ref
    for key in _PASS_THROUGH:
        children = schema.get(key)
        for child in children if isinstance(children, list) else ():
            if isinstance(child, Mapping):
                yield from _pass_through_refs(child)


def _check_ref_cycles(walk: _Walk) -> None:
    """A $ref chain that comes back to where it started without consuming input."""
    done: set[str] = set()
    for start in walk.refs:
        path: list[str] = []
        _visit(start, walk, path, done)


def _visit(node: str, walk: _Walk, path: list[str], done: set[str]) -> None:
    if node in path:
        cycle = " -> ".join([*path[path.index(node) :], node])
        raise ConstraintError(f"$ref cycle that never consumes input: {cycle}", walk.param)
    if node in done:
        return
    path.append(node)
    for target in walk.refs.get(node, ()):
        if target not in walk.refs:
            raise ConstraintError(f"$ref {target!r} points to nothing in the schema", walk.param)
        _visit(target, walk, path, done)
    path.pop()
    done.add(node)


def _escape(name: str) -> str:
    """A JSON pointer token (RFC 6901)."""
    return str(name).replace("~", "~0").replace("/", "~1")
