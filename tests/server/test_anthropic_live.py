"""Anthropic's Messages API on the real server, through the official SDK in strict mode."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from tests.server.live import LiveServer, live_server

MOON = [{"role": "user", "content": "Tell me about the moon in three sentences."}]
HI = [{"role": "user", "content": "Say hi."}]
VERSION = {"anthropic-version": "2023-06-01"}
# This SDK version dropped temperature / top_p / top_k kwargs; the API (and we) still take them.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(
        base_url=server.url, api_key="unused", max_retries=0, _strict_response_validation=True
    ) as c:
        yield c


@pytest.fixture(scope="module")
def model(server: LiveServer) -> str:
    return str(httpx.get(server.api + "/models").json()["data"][0]["id"])


def test_message_hits_max_tokens_with_exact_usage(client: anthropic.Anthropic, model: str) -> None:
    msg = client.messages.create(
        model=model, max_tokens=8, extra_body=GREEDY, system="You are terse.", messages=MOON
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.model == model
    assert msg.id.startswith("msg_")
    (block,) = msg.content
    assert block.type == "text" and block.text
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    assert msg.usage.output_tokens == 8
    counted = client.messages.count_tokens(model=model, system="You are terse.", messages=MOON)
    assert counted.input_tokens == msg.usage.input_tokens


def test_top_k_one_and_metadata(client: anthropic.Anthropic, model: str) -> None:
    greedy = client.messages.create(model=model, max_tokens=6, extra_body=GREEDY, messages=MOON)
    top1 = client.messages.create(
        model=model,
        max_tokens=6,
        messages=MOON,  # type: ignore[arg-type]
        metadata={"user_id": "user-1"},
        extra_body={"top_k": 1, "top_p": 0.9},
    )
    assert top1.content == greedy.content


def test_end_turn_when_the_model_finishes(client: anthropic.Anthropic, model: str) -> None:
    msg = client.messages.create(model=model, max_tokens=30, extra_body=GREEDY, messages=HI)
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    assert 0 < msg.usage.output_tokens < 30


def test_stop_sequence_is_reported(client: anthropic.Anthropic, model: str) -> None:
    base = client.messages.create(model=model, max_tokens=20, extra_body=GREEDY, messages=MOON)
    text = base.content[0].text  # type: ignore[union-attr]
    stop = text.split()[2]
    msg = client.messages.create(
        model=model, max_tokens=20, extra_body=GREEDY, messages=MOON, stop_sequences=[stop, "zzzz"]
    )
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]


def test_system_blocks_equal_a_system_string(client: anthropic.Anthropic, model: str) -> None:
    as_text = client.messages.create(
        model=model, max_tokens=6, extra_body=GREEDY, system="Answer in French.", messages=MOON
    )
    as_blocks = client.messages.create(
        model=model,
        max_tokens=6,
        extra_body=GREEDY,
        system=[{"type": "text", "text": "Answer in "}, {"type": "text", "text": "French."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": MOON[0]["content"]}]}],
    )
    assert as_blocks.content == as_text.content and as_blocks.usage == as_text.usage


def test_multi_turn_and_prefill(client: anthropic.Anthropic, model: str) -> None:
    turns: list[Any] = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Nice to meet you, Ada!"},
        {"role": "user", "content": "What is my name?"},
    ]
    msg = client.messages.create(model=model, max_tokens=12, extra_body=GREEDY, messages=turns)
    first = client.messages.count_tokens(model=model, messages=turns[:1]).input_tokens
    assert msg.usage.input_tokens > first
    prefilled = [*turns, {"role": "assistant", "content": "Your name is"}]
    out = client.messages.create(model=model, max_tokens=3, extra_body=GREEDY, messages=prefilled)
    counted = client.messages.count_tokens(model=model, messages=prefilled).input_tokens
    assert out.usage.input_tokens == counted > msg.usage.input_tokens
    assert not out.content[0].text.startswith("Your name is")  # type: ignore[union-attr]


def test_max_tokens_zero_generates_nothing(client: anthropic.Anthropic, model: str) -> None:
    msg = client.messages.create(model=model, max_tokens=0, messages=HI)  # type: ignore[arg-type]
    assert msg.content == [] and msg.stop_reason == "max_tokens"
    counted = client.messages.count_tokens(model=model, messages=HI)  # type: ignore[arg-type]
    assert msg.usage.input_tokens == counted.input_tokens and msg.usage.output_tokens == 0
    with client.messages.stream(model=model, max_tokens=0, messages=HI) as s:  # type: ignore[arg-type]
        final = s.get_final_message()
    assert final.content == [] and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 0


def _events(server: LiveServer, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    events: list[tuple[str, dict[str, Any]]] = []
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", server.api + "/messages", json=body, headers=VERSION) as resp,
    ):
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in resp.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                assert name is not None
                events.append((name, json.loads(line.removeprefix("data: "))))
                name = None
    return events


def test_stream_sends_the_events_in_order(
    server: LiveServer, client: anthropic.Anthropic, model: str
) -> None:
    body = {"model": model, "max_tokens": 10, "temperature": 0, "messages": MOON, "stream": True}
    events = _events(server, body)
    names = [name for name, _ in events]
    assert all(data["type"] == name for name, data in events)
    deltas = names.count("content_block_delta")
    assert deltas >= 1
    assert names == [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["output_tokens"] == 0
    assert events[1][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": "", "citations": None},
    }
    delta = events[-2][1]
    assert delta["delta"] == {
        "stop_reason": "max_tokens",
        "stop_sequence": None,
        "stop_details": None,
        "container": None,
    }
    assert delta["usage"]["output_tokens"] == 10
    assert delta["usage"]["input_tokens"] == start["usage"]["input_tokens"]
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    full = client.messages.create(model=model, max_tokens=10, extra_body=GREEDY, messages=MOON)
    assert text == full.content[0].text  # type: ignore[union-attr]
    assert start["usage"]["input_tokens"] == full.usage.input_tokens


def test_sdk_stream_helpers(client: anthropic.Anthropic, model: str) -> None:
    full = client.messages.create(model=model, max_tokens=12, extra_body=GREEDY, messages=MOON)
    with client.messages.stream(model=model, max_tokens=12, extra_body=GREEDY, messages=MOON) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == full.content[0].text  # type: ignore[union-attr]
    assert final.content[0].text == text  # type: ignore[union-attr]
    assert final.usage.output_tokens == full.usage.output_tokens
    assert final.stop_reason == full.stop_reason
    raw = list(
        client.messages.create(
            model=model, max_tokens=4, extra_body=GREEDY, messages=HI, stream=True
        )
    )
    assert raw[0].type == "message_start" and raw[-1].type == "message_stop"


def test_streamed_stop_sequence(client: anthropic.Anthropic, model: str) -> None:
    base = client.messages.create(model=model, max_tokens=20, extra_body=GREEDY, messages=MOON)
    stop = base.content[0].text.split()[3]  # type: ignore[union-attr]
    with client.messages.stream(
        model=model, max_tokens=20, extra_body=GREEDY, messages=MOON, stop_sequences=[stop]
    ) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def _error(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


def _envelope(body: Any, response: httpx.Response) -> dict[str, Any]:
    """An Anthropic error body less its request_id, which is the response's x-request-id."""
    assert body["request_id"] == response.headers["x-request-id"]
    return {k: v for k, v in body.items() if k != "request_id"}


ERRORS: list[tuple[str, Any, int, str, str]] = [
    (
        "invalid json",
        b"{nope",
        400,
        "invalid_request_error",
        "the request body is not valid JSON: Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1)",
    ),
    ("no max_tokens", {"messages": HI}, 400, "invalid_request_error", "max_tokens: is required"),
    (
        "no model",
        {"max_tokens": 5, "messages": HI},
        400,
        "invalid_request_error",
        "model: is required",
    ),
    (
        "empty messages",
        {"max_tokens": 5, "messages": []},
        400,
        "invalid_request_error",
        "messages: must contain at least one message",
    ),
    (
        "system role",
        {"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]},
        400,
        "invalid_request_error",
        "messages.0.role: Input should be 'user' or 'assistant'",
    ),
    (
        "image block",
        {
            "max_tokens": 5,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
                    ],
                }
            ],
        },
        400,
        "invalid_request_error",
        "messages.0.content.1.source.url: remote media URLs (http/https) are not allowed on this "
        "server (start it with --allow-remote-media)",
    ),
    (
        "file image block",
        {
            "max_tokens": 5,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "url", "url": "file:///etc/passwd"}}
                    ],
                }
            ],
        },
        400,
        "invalid_request_error",
        "messages.0.content.0.source.url: file:// URLs are not allowed on this server "
        "(start it with --allowed-media-root DIR)",
    ),
    (
        "orphan tool_result",
        {
            "max_tokens": 5,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t9", "content": "1"}],
                },
            ],
        },
        400,
        "invalid_request_error",
        "messages.0.content.0.tool_use_id: no tool_use block with id 't9' comes before it",
    ),
    (
        "unknown block",
        {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "sparkle"}]}]},
        400,
        "invalid_request_error",
        "messages.0.content.0: unknown content block type 'sparkle'",
    ),
    (
        "temperature",
        {"max_tokens": 5, "messages": HI, "temperature": 1.5},
        400,
        "invalid_request_error",
        "temperature: must be between 0 and 1, got 1.5",
    ),
    (
        "max_tokens negative",
        {"max_tokens": -1, "messages": HI},
        400,
        "invalid_request_error",
        "max_tokens: must be at least 0, got -1",
    ),
    (
        "five stops",
        {"max_tokens": 5, "messages": HI, "stop_sequences": ["a", "b", "c", "d", "e"]},
        400,
        "invalid_request_error",
        "stop_sequences: at most 4 stop strings, got 5",
    ),
    (
        "duplicate tools",
        {
            "max_tokens": 5,
            "messages": HI,
            "tools": [{"name": "f", "input_schema": {}}, {"name": "f", "input_schema": {}}],
        },
        400,
        "invalid_request_error",
        "tools.1.name: duplicate tool name 'f'",
    ),
    (
        "thinking",
        {"max_tokens": 5, "messages": HI, "thinking": {"type": "deep"}},
        400,
        "invalid_request_error",
        "thinking.type: must be one of enabled, adaptive, disabled",
    ),
    (
        "unknown model",
        {"model": "claude-nope", "max_tokens": 5, "messages": HI},
        404,
        "not_found_error",
        "the model 'claude-nope' does not exist on this server; available: {model}",
    ),
]


@pytest.mark.parametrize(
    ("name", "body", "status", "kind", "message"), ERRORS, ids=[e[0] for e in ERRORS]
)
def test_errors_use_anthropics_envelope(
    server: LiveServer, model: str, name: str, body: Any, status: int, kind: str, message: str
) -> None:
    if isinstance(body, dict):
        body = {"model": model} | body if name not in ("no model", "unknown model") else body
        content = json.dumps(body).encode()
    else:
        content = body
    headers = {"content-type": "application/json", **VERSION}
    r = httpx.post(server.api + "/messages", content=content, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    assert _envelope(r.json(), r) == _error(kind, message.format(model=model))


def test_context_overflow_is_an_anthropic_400(server: LiveServer, model: str) -> None:
    body = {
        "model": model,
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "w " * 2100}],
    }
    r = httpx.post(server.api + "/messages", json=body, headers=VERSION, timeout=30)
    assert r.status_code == 400
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert "2048" in err["error"]["message"]


def test_count_tokens_errors_and_sdk_exceptions(client: anthropic.Anthropic, model: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=model, max_tokens=-5, messages=HI)  # type: ignore[arg-type]
    assert bad.value.status_code == 400
    assert _envelope(bad.value.body, bad.value.response) == _error(
        "invalid_request_error", "max_tokens: must be at least 0, got -5"
    )
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.count_tokens(model="claude-nope", messages=HI)  # type: ignore[arg-type]
    assert _envelope(missing.value.body, missing.value.response) == _error(
        "not_found_error",
        f"the model 'claude-nope' does not exist on this server; available: {model}",
    )
    with pytest.raises(anthropic.BadRequestError) as empty:
        client.messages.count_tokens(model=model, messages=[])
    assert _envelope(empty.value.body, empty.value.response) == _error(
        "invalid_request_error", "messages: must contain at least one message"
    )


def test_unknown_routes_answer_in_the_callers_envelope(server: LiveServer) -> None:
    r = httpx.get(server.api + "/nothing-here", headers=VERSION)
    assert r.status_code == 404
    assert _envelope(r.json(), r) == _error("not_found_error", "no route GET /v1/nothing-here")
    r = httpx.get(server.api + "/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(server.api + "/messages", headers=VERSION)
    assert r.status_code == 405
    assert _envelope(r.json(), r) == _error(
        "invalid_request_error", "method GET is not allowed on /v1/messages"
    )


# -- the media policy applies to image and document blocks, as to chat's media parts --------------
MAX_MEDIA = 4096
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 56


@pytest.fixture(scope="module")
def media_server(
    smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LiveServer, Path]]:
    """A server that allows file:// media under one root, with a 4 KiB media cap."""
    tmp = tmp_path_factory.mktemp("anthropic-media")
    root = tmp / "media"
    root.mkdir()
    (root / "cat.png").write_bytes(PNG)
    args = [
        *("-m", str(smollm2_gguf), "--dtype", "f32", "--max-seqs", "2", "--max-seq-len", "512"),
        *("--allowed-media-root", str(root), "--max-media-bytes", str(MAX_MEDIA)),
    ]
    with live_server(args, tmp / "serve.log") as live:
        yield live, root


def _image(source: dict[str, Any]) -> list[dict[str, Any]]:
    content = [{"type": "text", "text": "what is this?"}, {"type": "image", "source": source}]
    return [{"role": "user", "content": content}]


def _base64(data: bytes) -> dict[str, Any]:
    return {"type": "base64", "media_type": "image/png", "data": base64.b64encode(data).decode()}


MEDIA_CASES: list[tuple[str, Any, str]] = [
    (
        "file outside the root",
        lambda root: {"type": "url", "url": "file:///etc/passwd"},
        "messages.0.content.1.source.url: the file is outside the allowed media roots",
    ),
    (
        "dot-dot traversal",
        lambda root: {"type": "url", "url": f"file://{root}/../serve.log"},
        "messages.0.content.1.source.url: the file path must not contain '..'",
    ),
    (
        "base64 over the cap",
        lambda root: _base64(b"x" * (MAX_MEDIA + 1)),
        f"messages.0.content.1.source.data: the media is larger than {MAX_MEDIA} bytes "
        "(--max-media-bytes)",
    ),
    (
        "data URL over the cap",
        lambda root: {
            "type": "url",
            "url": "data:image/png;base64," + base64.b64encode(b"x" * 5000).decode(),
        },
        f"messages.0.content.1.source.url: the media is larger than {MAX_MEDIA} bytes "
        "(--max-media-bytes)",
    ),
    (
        "allowed file, text-only model",
        lambda root: {"type": "url", "url": f"file://{root}/cat.png"},
        "messages.0.content.1: the model {model!r} does not accept image input; it accepts text",
    ),
    (
        "small base64, text-only model",
        lambda root: _base64(PNG),
        "messages.0.content.1: the model {model!r} does not accept image input; it accepts text",
    ),
]


@pytest.mark.parametrize(
    ("name", "source", "message"), MEDIA_CASES, ids=[c[0] for c in MEDIA_CASES]
)
@pytest.mark.parametrize("route", ["/messages", "/messages/count_tokens"])
def test_media_policy_answers_in_anthropics_envelope(
    media_server: tuple[LiveServer, Path], route: str, name: str, source: Any, message: str
) -> None:
    live, root = media_server
    model = str(httpx.get(live.api + "/models").json()["data"][0]["id"])
    body = {"model": model, "max_tokens": 4, "messages": _image(source(root))}
    r = httpx.post(live.api + route, json=body, headers=VERSION, timeout=60)
    assert r.status_code == 400, r.text
    assert _envelope(r.json(), r) == _error("invalid_request_error", message.format(model=model))


def test_media_refusals_through_the_sdk(media_server: tuple[LiveServer, Path]) -> None:
    live, root = media_server
    with anthropic.Anthropic(
        base_url=live.url, api_key="unused", max_retries=0, _strict_response_validation=True
    ) as client:
        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(
                model="default",
                max_tokens=4,
                messages=_image({"type": "url", "url": f"file://{root}/../serve.log"}),  # type: ignore[arg-type]
            )
        assert _envelope(info.value.body, info.value.response) == _error(
            "invalid_request_error",
            "messages.0.content.1.source.url: the file path must not contain '..'",
        )
        ok = client.messages.create(model="default", max_tokens=2, messages=HI)  # still serving
        assert ok.type == "message" and ok.usage.output_tokens >= 1
