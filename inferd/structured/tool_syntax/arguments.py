"""The schema a tool call's arguments are held to, from the tool's ``parameters``.

Two changes from the schema as sent, both for the grammar only (the model is shown the tool as
sent):

- Closed objects. JSON Schema lets an object carry keys its ``properties`` do not list unless it
  says ``additionalProperties: false``; the schemas clients generate (pydantic, instructor,
  langchain) rarely say it, and a small model held only to the schema fills a call with invented
  keys until it runs out of tokens. Like OpenAI's strict mode, an object that lists
  ``properties`` and says nothing about other keys is closed; a tool sent with ``strict: false``
  keeps the schema's own reading. An object without ``properties`` (a free-form mapping) stays
  open, and so do the objects ``allOf`` combines, or a ``$ref`` extends, where closing one part
  would refuse the other's keys.
- Rebased references. A call's grammar places the arguments schema inside a larger one, where a
  local ``$ref`` (``#/$defs/Loc``, what pydantic writes) no longer points into it: ``rebased``
  rewrites them to the place the schema takes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Keywords whose value is a schema, a map of schemas, or a list of schemas.
_ONE = frozenset(
    {
        "items",
        "additionalItems",
        "additionalProperties",
        "contains",
        "not",
        "if",
        "then",
        "else",
        "propertyNames",
        "unevaluatedItems",
        "unevaluatedProperties",
    }
)
_MAP = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_LIST = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
# Keys that already say what an object does with keys it does not list.
_OTHER_KEYS = ("additionalProperties", "unevaluatedProperties", "patternProperties")
# Keywords whose value is data, not schema: a "$ref" key inside them is not a reference.
_DATA = frozenset({"const", "enum", "default", "examples"})


def closed(schema: Any, *, combined: bool = False) -> Any:
    """``schema`` with every object that lists ``properties`` and says nothing about other keys
    closed (``additionalProperties: false``); ``combined``: ``schema`` is one part of an
    ``allOf``, left as it is (its siblings may add keys)."""
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _ONE and isinstance(value, Mapping):
            out[key] = closed(value)
        elif key == "items" and isinstance(value, list):  # draft 4-7 tuple form
            out[key] = [closed(v) for v in value]
        elif key in _MAP and isinstance(value, Mapping):
            out[key] = {k: closed(v) for k, v in value.items()}
        elif key in _LIST and isinstance(value, list):
            out[key] = [closed(v, combined=key == "allOf") for v in value]
        else:
            out[key] = value
    silent = not any(k in schema for k in _OTHER_KEYS)
    extended = combined or "allOf" in schema or "$ref" in schema
    if "properties" in schema and silent and not extended:
        out["additionalProperties"] = False
    return out


def has_refs(schema: Any) -> bool:
    """Whether ``schema`` holds a local ``$ref`` (``#`` or ``#/...``) outside its data."""
    if isinstance(schema, Mapping):
        if _local(schema.get("$ref")):
            return True
        return any(has_refs(v) for k, v in schema.items() if k not in _DATA)
    if isinstance(schema, list):
        return any(has_refs(v) for v in schema)
    return False


def rebased(schema: Any, at: str) -> Any:
    """``schema`` with its local references rewritten for a schema placed at the JSON pointer
    ``at`` of a larger one: ``#`` becomes ``#AT`` and ``#/$defs/X`` becomes ``#AT/$defs/X``."""
    if isinstance(schema, list):
        return [rebased(v, at) for v in schema]
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and _local(value):
            out[key] = f"#{at}{value[1:]}"
        elif key in _DATA:
            out[key] = value
        else:
            out[key] = rebased(value, at)
    return out


def _local(ref: Any) -> bool:
    """A reference by JSON pointer into the same document (not a URI, not an ``#anchor``)."""
    return isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))
