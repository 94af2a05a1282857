"""Fuzzing every POST route of a live server (issue 10, "Done means"): arbitrary JSON values,
objects built from the fields the routes know, and arbitrary bytes. Whatever comes in, the
answer is never a 5xx, every error is in the caller's envelope with a request id, and the
server is healthy with no KV blocks held afterwards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.server.hostile import ANTHROPIC, POST_ROUTES, assert_healthy, envelope, hostile_server
from tests.server.live import LiveServer

EXAMPLES = 34  # per route and strategy: 102 requests per route
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None)

FIELDS = (
    "model",
    "messages",
    "prompt",
    "input",
    "tokens",
    "system",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_sequences",
    "n",
    "stream",
    "stream_options",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "echo",
    "suffix",
    "best_of",
    "encoding_format",
    "dimensions",
    "add_special_tokens",
    "add_generation_prompt",
    "return_token_strs",
    "response_format",
    "tools",
    "tool_choice",
    "metadata",
    "instructions",
    "max_output_tokens",
    "text",
    "previous_response_id",
    "store",
    "background",
    "truncation",
    "parallel_tool_calls",
    "model_id",
    "drain_timeout",
)
# Fields whose large values would make a valid request generate for long, with their caps.
_CAPS = {
    "max_tokens": 2,
    "max_completion_tokens": 2,
    "max_output_tokens": 2,
    "n": 2,
    "best_of": 2,
}

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30)
    | st.sampled_from(["default", "user", "assistant", "system", "text", "<|im_start|>", ""])
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
parts = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "image", "tool_use", "weird"])},
    optional={"text": scalars, "image_url": json_values, "source": json_values},
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]) | scalars},
        optional={"content": scalars | st.lists(parts, max_size=3), "name": scalars},
    ),
    max_size=4,
)
known_objects = st.fixed_dictionaries(
    {},
    optional={
        **dict.fromkeys(FIELDS, json_values),
        "messages": messages,
        "prompt": st.text(max_size=40) | st.lists(st.integers(-5, 50_000), max_size=6),
        "tokens": st.lists(st.integers(-5, 50_000), max_size=6),
    },
)


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("hostile-fuzz") / "serve.log"
    with hostile_server(smollm2_gguf, log) as live:
        yield live


def _short(body: Any) -> Any:
    """A valid request may generate; keep what it asks for small (the fuzzing is elsewhere)."""
    if isinstance(body, dict):
        body.setdefault("max_tokens", 1)
        body.setdefault("max_output_tokens", 1)  # /v1/responses
        for key, cap in _CAPS.items():
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > cap:
                body[key] = cap
    return body


@pytest.fixture(scope="module")
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:  # one kept-alive connection
        yield client


def _post(http: httpx.Client, path: str, content: bytes) -> None:
    anthropic = path.startswith("/v1/messages")
    headers = {"content-type": "application/json"} | (ANTHROPIC if anthropic else {})
    r = http.post(path, content=content, headers=headers)
    assert r.status_code < 500, (r.status_code, r.text[:500], content[:300])
    assert r.headers.get("x-request-id")
    if r.status_code >= 400:
        envelope(r, anthropic=anthropic)
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert "server_error" not in r.text and "api_error" not in r.text, r.text[-500:]
    else:
        r.json()


def _routes() -> list[str]:
    return [path for path, _ in POST_ROUTES]


@pytest.mark.parametrize("path", _routes())
def test_fuzz_json_values(server: LiveServer, http: httpx.Client, path: str) -> None:
    @FUZZ
    @given(json_values)
    def run(value: Any) -> None:
        _post(http, path, json.dumps(_short(value)).encode())

    run()
    assert_healthy(server)


@pytest.mark.parametrize("path", _routes())
def test_fuzz_objects_of_known_fields(server: LiveServer, http: httpx.Client, path: str) -> None:
    @FUZZ
    @given(known_objects)
    def run(body: dict[str, Any]) -> None:
        _post(http, path, json.dumps(_short(body)).encode())

    run()
    assert_healthy(server)


@pytest.mark.parametrize("path", _routes())
def test_fuzz_bytes(server: LiveServer, http: httpx.Client, path: str) -> None:
    @FUZZ
    @given(st.binary(max_size=200))
    def run(raw: bytes) -> None:
        _post(http, path, raw)

    run()
    assert_healthy(server)
