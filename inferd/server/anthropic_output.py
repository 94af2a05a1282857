"""Anthropic structured outputs on /v1/messages: ``output_config.format``, an object
``{"type": "json_schema", "schema": {...}}`` (what the SDK sends, for ``output_config=`` and for
``messages.parse(output_format=Model)`` alike), or the same object as the top-level
``output_format`` of the earlier beta. The reply's text is held to the schema by the same
constrained decoding as OpenAI's ``response_format`` json_schema, after the same checks.
"""

from __future__ import annotations

from typing import Any

from inferd.server.errors import bad_request
from inferd.structured.constraint import Constraint, ConstraintError


def output_format(
    output_config: dict[str, Any] | None, beta_format: dict[str, Any] | None
) -> tuple[Constraint, Any, str] | None:
    """The request's output schema as (constraint, schema, the field it came from), or None.
    400 naming the field when it is malformed, or a schema we do not accept."""
    given = output_config.get("format") if output_config is not None else None
    param = "output_config.format"
    if beta_format is not None:
        if given is not None:
            raise bad_request(
                "output_format and output_config.format: give the output format once",
                "output_format",
            )
        given, param = beta_format, "output_format"
    if given is None:
        return None
    if not isinstance(given, dict) or given.get("type") != "json_schema":
        kind = given.get("type") if isinstance(given, dict) else type(given).__name__
        raise bad_request(f"{param}.type must be json_schema, not {kind!r}", f"{param}.type")
    schema = given.get("schema")
    if not isinstance(schema, dict):
        raise bad_request(f"{param}.schema must be a JSON schema object", f"{param}.schema")
    try:
        return Constraint.json_schema(schema, f"{param}.schema"), schema, f"{param}.schema"
    except ConstraintError as exc:
        where = exc.param or f"{param}.schema"
        raise bad_request(f"{where}: {exc}", where) from None
