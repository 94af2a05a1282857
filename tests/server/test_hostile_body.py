"""Hostile request bodies (issue 10, items 2 and 8) against a live server: JSON the decoder
cannot bound on its own, values of the wrong type, nullable fields, huge quoted values; and the
catch-all that turns any internal error into a 500 envelope with the request id."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.requests import Request

from inferd.server.app import build_app
from inferd.server.errors import MAX_MESSAGE_CHARS
from inferd.server.options import ServerOptions
from tests.server.hostile import (
    ANTHROPIC,
    POST_ROUTES,
    assert_healthy,
    envelope,
    hostile_server,
    refused,
)
from tests.server.live import LiveServer

HI = [{"role": "user", "content": "Say hi."}]
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("hostile-body") / "serve.log"
    with hostile_server(smollm2_gguf, log) as live:
        yield live


# (name, body, what the 400 says): each was a plain-text 500 before.
UNBOUNDED = [
    ("nested 5000 deep", b"[" * 5000 + b"]" * 5000, "nested deeper than 64"),
    ("nested in a field", b'{"model": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested deeper"),
    ("nested 65 deep", b'{"metadata": ' + b"[" * 65 + b"]" * 65 + b"}", "nested deeper"),
    ("lone surrogate", b'{"model": "\\ud800", "messages": []}', "lone surrogate \\ud800"),
    ("lone surrogate key", b'{"\\udfff": 1}', "lone surrogate \\udfff"),
    ("5000-digit integer", b'{"max_tokens": ' + b"7" * 5000 + b"}", "5000 characters long"),
    ("long float", b'{"temperature": 0.' + b"5" * 200 + b"}", "202 characters long"),
    ("NaN", b'{"temperature": NaN}', "NaN is not a JSON value"),
    ("Infinity", b'{"temperature": -Infinity}', "-Infinity is not a JSON value"),
    ("not UTF-8", b'{"model": "\xff"}', "not UTF-8"),
]


@pytest.mark.parametrize(("name", "body", "says"), UNBOUNDED, ids=[u[0] for u in UNBOUNDED])
def test_unbounded_json_is_a_400_on_every_route(
    server: LiveServer, name: str, body: bytes, says: str
) -> None:
    for path, anthropic in POST_ROUTES:
        headers = JSON | (ANTHROPIC if anthropic else {})
        r = httpx.post(server.url + path, content=body, headers=headers, timeout=60)
        error = refused(r, 400, anthropic=anthropic, says=says)
        assert error["message"].startswith("the request body is not valid JSON"), error
        if not anthropic:
            assert error["code"] == "invalid_json"
    assert_healthy(server)


def test_paired_surrogates_are_one_character(server: LiveServer) -> None:
    """What json.dumps(ensure_ascii=True) sends for an emoji stays valid."""
    body = b'{"prompt": "\\ud83d\\ude00"}'
    r = httpx.post(server.url + "/v1/tokenize", content=body, headers=JSON, timeout=60)
    assert r.status_code == 200
    back = httpx.post(
        server.url + "/v1/detokenize", json={"tokens": r.json()["tokens"]}, timeout=60
    )
    assert back.json() == {"prompt": "\U0001f600"}


# (route, body, the field the 400 names): coerced before ("10" -> 10, "yes" -> True).
LAX = [
    ("/v1/chat/completions", {"messages": HI, "max_tokens": "10"}, "max_tokens"),
    ("/v1/chat/completions", {"messages": HI, "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"messages": HI, "n": True}, "n"),
    ("/v1/chat/completions", {"messages": HI, "temperature": "0.5"}, "temperature"),
    ("/v1/chat/completions", {"messages": HI, "seed": 1.5}, "seed"),
    ("/v1/chat/completions", {"messages": HI, "logprobs": 1}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": "10"}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": True}, "logprobs"),
    ("/v1/tokenize", {"prompt": "Hi", "add_special_tokens": "no"}, "add_special_tokens"),
    ("/v1/detokenize", {"tokens": [True]}, "tokens.0"),
    ("/v1/embeddings", {"input": "Hi", "dimensions": "8"}, "dimensions"),
    ("/v1/models/status", {"model_id": 5}, "model_id"),
    ("/v1/messages", {"model": "x", "messages": HI, "max_tokens": "10"}, "max_tokens"),
    ("/v1/messages", {"model": "x", "messages": HI, "max_tokens": 5, "stream": 1}, "stream"),
    ("/v1/messages/count_tokens", {"model": 7, "messages": HI}, "model"),
]


@pytest.mark.parametrize(("path", "body", "param"), LAX, ids=[f"{p}-{f}" for p, _, f in LAX])
def test_wrong_types_are_refused_naming_the_field(
    server: LiveServer, path: str, body: dict[str, Any], param: str
) -> None:
    anthropic = path.startswith("/v1/messages")
    r = httpx.post(server.url + path, json=body, headers=ANTHROPIC if anthropic else {}, timeout=60)
    error = refused(r, 400, anthropic=anthropic, says=f"{param}: ")
    if not anthropic:
        assert error["param"] == param
    assert_healthy(server)


# (route, body, the field the 400 names, what it says): each was a 500 before (an object or
# array as a part's type failed a dict lookup; a Responses item's id reached the SQLite store).
MALFORMED = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": {}}]}]}, "type"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": []}]}]}, "type"),
    (
        "/v1/messages/count_tokens",
        {"messages": [{"role": "user", "content": [{"type": {"a": 1}, "text": "x"}]}]},
        "type",
    ),
    (
        "/v1/messages",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": {}}]}
                    ],
                }
            ]
        },
        "content.0.type",
    ),
    ("/v1/responses", {"input": [{"type": "reasoning", "id": {}, "summary": []}, "Hi"]}, "id"),
    ("/v1/responses", {"input": [{"role": "user", "content": "Hi", "id": [1]}]}, "id"),
    (
        "/v1/responses",
        {
            "input": [
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "id": 5}
            ]
        },
        "id",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "field"), MALFORMED, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(MALFORMED)]
)
def test_a_non_string_type_or_id_is_a_400_before_any_engine_work(
    server: LiveServer, path: str, body: dict[str, Any], field: str
) -> None:
    anthropic = path.startswith("/v1/messages")
    body = {"model": "default", "max_tokens": 2, "max_output_tokens": 2} | body
    before = server.metric("inferd_prompt_tokens_total")
    r = httpx.post(server.url + path, json=body, headers=ANTHROPIC if anthropic else {}, timeout=60)
    refused(r, 400, anthropic=anthropic, says=f"{field} must be a string")
    assert server.metric("inferd_prompt_tokens_total") == before
    assert_healthy(server)


# (route, body, an integer field sent as a whole-number float): JSON Schema's integer takes
# 2.0, so the official specs do; each was a 400 "should be a valid integer" before.
WHOLE = [
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 2.0, "n": 2.0, "seed": 7.0}),
    (
        "/v1/chat/completions",
        {"messages": HI, "max_completion_tokens": 2.0, "top_k": 5.0},
    ),
    (
        "/v1/chat/completions",
        {"messages": HI, "max_tokens": 2, "logprobs": True, "top_logprobs": 2.0},
    ),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2.0, "logprobs": 1.0, "best_of": 1.0}),
    ("/v1/messages", {"model": "x", "messages": HI, "max_tokens": 2.0, "top_k": 5.0}),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 16.0}),
]


@pytest.mark.parametrize(
    ("path", "body"), WHOLE, ids=[f"{p}-{i}" for i, (p, _) in enumerate(WHOLE)]
)
def test_whole_number_floats_are_integers(
    server: LiveServer, path: str, body: dict[str, Any]
) -> None:
    anthropic = path == "/v1/messages"
    body = body | {"model": "default"}
    r = httpx.post(
        server.url + path, json=body, headers=ANTHROPIC if anthropic else {}, timeout=120
    )
    assert r.status_code == 200, r.text
    out = r.json()
    if path == "/v1/responses":
        assert out["max_output_tokens"] == 16 and out["usage"]["output_tokens"] <= 16
    elif anthropic:
        assert out["usage"]["output_tokens"] <= 2
    else:
        assert out["usage"]["completion_tokens"] <= 2 * len(out["choices"])
        assert len(out["choices"]) == body.get("n", 1)
    # the fraction is still refused
    fraction = {k: v + 0.5 if isinstance(v, float) else v for k, v in body.items()}
    r = httpx.post(
        server.url + path, json=fraction, headers=ANTHROPIC if anthropic else {}, timeout=60
    )
    refused(r, 400, anthropic=anthropic, says="valid integer")


# Every field OpenAI's spec marks nullable that these routes read, sent as null.
CHAT_NULLS = [
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "metadata",
    "modalities",
    "audio",
    "prediction",
]
COMPLETION_NULLS = [
    "best_of",
    "echo",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "n",
    "presence_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "suffix",
    "temperature",
    "top_p",
]


def test_nullable_fields_take_null_as_the_default(server: LiveServer) -> None:
    # max_completion_tokens is nullable too, but a null pair means "up to the context"
    chat = {"messages": HI, "max_completion_tokens": 8} | dict.fromkeys(CHAT_NULLS)
    r = httpx.post(server.api + "/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion"
    completion = {"prompt": "Once upon a time"} | dict.fromkeys(COMPLETION_NULLS)
    r = httpx.post(server.api + "/completions", json=completion, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 16  # OpenAI's default max_tokens
    assert_healthy(server)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_huge_value_is_not_echoed_back_whole(server: LiveServer, path: str) -> None:
    anthropic = path == "/v1/messages"
    name = "m" * 1_000_000
    body = {"model": name, "messages": HI, "max_tokens": 4}
    r = httpx.post(server.url + path, json=body, headers=ANTHROPIC if anthropic else {}, timeout=60)
    error = refused(r, 404, anthropic=anthropic, says="does not exist")
    assert len(error["message"]) < MAX_MESSAGE_CHARS + 40
    assert "m" * 300 not in error["message"]
    assert "characters ..." in error["message"]
    assert_healthy(server)


def test_an_internal_error_is_a_500_envelope_with_the_request_id() -> None:
    """A route that raises: no handler knows the exception, the catch-all answers."""
    app = build_app([], ServerOptions(access_log_format=None))

    async def broken(request: Request) -> None:
        raise RuntimeError("a bug in a route")

    app.add_api_route("/v1/broken", broken, methods=["POST"])
    app.add_api_route("/v1/messages/broken", broken, methods=["POST"])

    async def call(path: str, request_id: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            return await c.post(path, json={}, headers={"x-request-id": request_id})

    for path, anthropic in (("/v1/broken", False), ("/v1/messages/broken", True)):
        r = asyncio.run(call(path, "req-42"))
        assert r.status_code == 500
        assert r.headers["x-request-id"] == "req-42"
        error = envelope(r, anthropic=anthropic)
        assert "req-42" in error["message"] and "a bug in a route" not in error["message"]
        assert error["type"] == ("api_error" if anthropic else "server_error")
