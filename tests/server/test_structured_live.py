"""Structured output through the official SDK against a real server: response_format
json_object and json_schema, inferd's regex / choice / grammar extensions on chat and text
completions, streamed == non-streamed under greedy, and bad constraints refused by name."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.server.live import LiveServer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


def _schema_format(schema: Any, name: str = "person") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_json_object_choices_parse(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(
        model=model,
        messages=ASK,  # type: ignore[arg-type]
        response_format={"type": "json_object"},
        n=4,
        seed=3,
        temperature=1.0,
        max_tokens=200,
    )
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(json.loads(choice.message.content or ""), dict)


def test_json_schema_choices_validate(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(
        model=model,
        messages=ASK,  # type: ignore[arg-type]
        response_format=_schema_format(PERSON),  # type: ignore[arg-type]
        n=4,
        seed=11,
        temperature=1.0,
        max_tokens=200,
    )
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)


def test_streamed_equals_non_streamed_under_greedy(client: openai.OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = {
        "model": model,
        "messages": ASK,
        "response_format": _schema_format(PERSON),
        "temperature": 0,
        "max_tokens": 200,
    }
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(streamed), PERSON)


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
        ({"choice": ["cat", "dog", "bird"]}, lambda t: t in ("cat", "dog", "bird")),
        ({"grammar": 'start: ("yes" | "no") "!"'}, lambda t: t in ("yes!", "no!")),
        ({"grammar": 'root ::= [a-c] [a-c]? "."'}, lambda t: re.fullmatch(r"[a-c]{1,2}\.", t)),
    ],
    ids=["regex", "choice", "lark", "gbnf"],
)
def test_extensions_hold_on_chat_and_completions(
    client: openai.OpenAI, model: str, extra: dict[str, Any], check: Any
) -> None:
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Answer."}],
        n=3,
        seed=1,
        temperature=1.0,
        max_tokens=30,
        extra_body=extra,
    )
    text = client.completions.create(
        model=model, prompt="Answer:", n=3, seed=1, temperature=1.0, max_tokens=30, extra_body=extra
    )
    outputs = [c.message.content for c in chat.choices] + [c.text for c in text.choices]
    for output in outputs:
        assert check(output), output


def test_completions_take_response_format(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(
        model=model,
        prompt="A person as JSON:",
        temperature=0,
        max_tokens=200,
        extra_body={"response_format": _schema_format(PERSON)},
    )
    jsonschema.validate(json.loads(out.choices[0].text), PERSON)


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


SCHEMA = "response_format.json_schema.schema"
BAD = [
    ("unknown keyword", {"response_format": _schema_format({"typ": "object"})}, SCHEMA, "'typ'"),
    (
        "ref cycle",
        {
            "response_format": _schema_format(
                {
                    "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                    "$ref": "#/$defs/a",
                }
            )
        },
        SCHEMA,
        "$ref cycle",
    ),
    (
        "huge enum",
        {"response_format": _schema_format({"enum": [str(i) for i in range(100_000)]})},
        SCHEMA,
        "more than 1000 values",
    ),
    ("deep", {"response_format": _schema_format(_nested(20))}, SCHEMA, "nests deeper"),
    (
        "unsupported keyword",
        {"response_format": _schema_format({"not": {"type": "string"}})},
        SCHEMA,
        "not",
    ),
    (
        "bad name",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
        "response_format.json_schema.name",
        "letters, digits",
    ),
    (
        "no json_schema",
        {"response_format": {"type": "json_schema"}},
        "response_format.json_schema",
        "is required",
    ),
    ("bad regex", {"regex": "("}, "regex", "unclosed group"),
    ("bad grammar", {"grammar": "start: nowhere"}, "grammar", "nowhere"),
    ("empty choice", {"choice": []}, "choice", "non-empty"),
    ("two at once", {"regex": "a", "choice": ["a"]}, "choice", "one way only"),
]


@pytest.mark.parametrize(("name", "extra", "param", "needle"), BAD, ids=[b[0] for b in BAD])
@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
def test_bad_constraints_are_400s_naming_the_problem(
    server: LiveServer, path: str, name: str, extra: dict[str, Any], param: str, needle: str
) -> None:
    body = {"max_tokens": 5} | extra
    body |= {"messages": ASK} if path == "/chat/completions" else {"prompt": "x"}
    r = httpx.post(server.api + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    assert needle in err["message"]
