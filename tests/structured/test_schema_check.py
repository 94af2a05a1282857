"""Schemas refused before compiling, each with a message that names the problem and where."""

from __future__ import annotations

from typing import Any

import pytest

from inferd.structured.constraint import Constraint, ConstraintError
from inferd.structured.schema_check import MAX_DEPTH, MAX_ENUM_VALUES, check_schema

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "object", "proprties": {}}, "unknown keyword 'proprties' at #"),
        (
            {"type": "object", "properties": {"a": {"type": "strng"}}},
            "unknown type 'strng' at #/properties/a",
        ),
        ({"enum": list(range(MAX_ENUM_VALUES + 1))}, f"more than {MAX_ENUM_VALUES} values"),
        (_nested(MAX_DEPTH + 1), f"deeper than {MAX_DEPTH} levels"),
        (
            {
                "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"anyOf": [{"$ref": "#/$defs/a"}]}},
                "$ref": "#/$defs/a",
            },
            "$ref cycle that never consumes input: #/$defs/a -> #/$defs/b -> #/$defs/a",
        ),
        ({"$ref": "#/$defs/missing"}, "points to nothing"),
        ({"$ref": "https://example.com/s.json"}, "only references inside the schema"),
        ({"type": "object", "required": "name"}, "required at # must be an array of strings"),
        ({"properties": {"a": 3}}, "the subschema at #/properties/a must be an object"),
    ],
)
def test_bad_schemas_are_refused_with_the_problem_named(schema: Any, message: str) -> None:
    with pytest.raises(ConstraintError) as caught:
        Constraint.json_schema(schema, param="response_format")
    assert message in str(caught.value)
    assert caught.value.param == "response_format"


def test_recursion_through_properties_and_the_usual_annotations_are_accepted() -> None:
    tree = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "Node",
        "description": "a tree",
        "type": "object",
        "properties": {
            "value": {"type": "integer", "default": 0, "examples": [1]},
            "children": {"type": "array", "items": {"$ref": "#"}},
            "meta": {"x-vendor": True, "anyOf": [{"type": "null"}, {"$ref": "#/$defs/m"}]},
        },
        "$defs": {"m": {"type": "object", "additionalProperties": False}},
        "required": ["value"],
    }
    check_schema(tree)
    check_schema(_nested(MAX_DEPTH - 1))
    check_schema(True)


def test_equal_schemas_share_a_digest_and_property_order_is_kept() -> None:
    a = Constraint.json_schema(PERSON)
    b = Constraint.json_schema(dict(PERSON))
    reordered = Constraint.json_schema(
        {**PERSON, "properties": {"age": {"type": "integer"}, "name": {"type": "string"}}}
    )
    assert a.digest == b.digest
    assert a.digest != reordered.digest  # generation follows the schema's property order
    assert a.source.index('"name"') < a.source.index('"age"')


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Constraint.choice([]), "non-empty list"),
        (lambda: Constraint.choice("abc"), "non-empty list"),
        (lambda: Constraint.choice(["a", ""]), "each choice must be a string"),
        (lambda: Constraint.regex(""), "non-empty string"),
        (lambda: Constraint.grammar("  "), "non-empty string"),
        (lambda: Constraint.json_schema([1]), "must be an object"),
    ],
)
def test_malformed_constraints_are_refused(build: Any, message: str) -> None:
    with pytest.raises(ConstraintError, match=message):
        build()


def test_the_facade_exports_constraint() -> None:
    import inferd

    assert inferd.Constraint is Constraint
    params = inferd.SamplingParams(constraint=inferd.Constraint.choice(["a", "b"]))
    assert params.constraint == Constraint.choice(["a", "b"])


@pytest.mark.parametrize(
    "schema", [{"type": [{"a": 1}]}, {"anyOf": 3}, {"enum": "abc"}, {"$ref": 5}]
)
def test_malformed_keyword_values_are_400s_not_crashes(schema: Any) -> None:
    with pytest.raises(ConstraintError):
        check_schema(schema)
