"""--request-timeout on a real server, plus the settings the operations module leaves at default:
keys from INFERD_API_KEYS, no docs, no CORS, the text access log.

The timeout is 4 s, time enough for first tokens on a busy two-core machine; the requests meant
to time out ask for 900 tokens with ignore_eos, which takes far longer on any CPU this runs on.
Anthropic's API has no ignore_eos: its requests prefill a reply that repeats one word,
which greedy decoding keeps repeating.

Every generating route is covered: chat and text completions (504 in OpenAI's envelope, or an
error event then [DONE] mid-stream) and messages (504 in Anthropic's envelope, or an error
event mid-stream).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from inferd.contract.reconcile import ServerRecord, reconcile
from inferd.contract.stream import Expectation, SchedulerCancelled, StreamConsumer, UsageSource
from tests.server.live import LiveServer, live_server

ENV_KEYS = ("env-key-1", "env-key-2")
AUTH = {"Authorization": f"Bearer {ENV_KEYS[1]}"}
TIMEOUT_MESSAGE = "the request timed out after 4s (--request-timeout) while generating"
LONG: dict[str, Any] = {
    "messages": [{"role": "user", "content": "Write a very long story about the sea."}],
    "max_tokens": 900,
    "ignore_eos": True,
}
REPEAT: list[Any] = [
    {"role": "user", "content": "Write the word apple nine hundred times."},
    {"role": "assistant", "content": "apple " * 24},
]
OPENAI_TIMEOUT = {
    "message": TIMEOUT_MESSAGE,
    "type": "timeout_error",
    "param": None,
    "code": "request_timeout",
}
ANTHROPIC_TIMEOUT = {
    "type": "error",
    "error": {"type": "timeout_error", "message": TIMEOUT_MESSAGE},
}


def _without_request_id(body: Any) -> dict[str, Any]:
    """An Anthropic error body less the request id it carries."""
    assert isinstance(body["request_id"], str) and body["request_id"]
    return {k: v for k, v in body.items() if k != "request_id"}


def _openai(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.api, api_key=ENV_KEYS[0], max_retries=0, _strict_response_validation=True
    )


def _anthropic(server: LiveServer, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=server.url, api_key=key, max_retries=0, _strict_response_validation=True
    )


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("timeout")
    args = [
        *("-m", str(smollm2_gguf), "--dtype", "f32", "--max-seqs", "4", "--max-seq-len", "1024"),
        *("--request-timeout", "4", "--no-docs", "--access-log-format", "text"),
    ]
    saved = os.environ.get("INFERD_API_KEYS")
    os.environ["INFERD_API_KEYS"] = f" {ENV_KEYS[0]}, {ENV_KEYS[1]} ,"
    try:
        context = live_server(args, tmp / "serve.log")
        live = context.__enter__()  # the child has copied the environment once this returns
    finally:
        if saved is None:
            del os.environ["INFERD_API_KEYS"]
        else:
            os.environ["INFERD_API_KEYS"] = saved
    try:
        yield live
    finally:
        context.__exit__(None, None, None)


@pytest.fixture(scope="module")
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as client:
        yield client


def metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_keys_come_from_the_environment(server: LiveServer) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as bare:
        assert bare.get("/v1/models").status_code == 401
        for key in ENV_KEYS:
            assert bare.get("/v1/models", headers={"x-api-key": key}).status_code == 200
        assert bare.get("/v1/models", headers={"x-api-key": ""}).status_code == 401


def test_docs_are_off_and_cors_is_off_by_default(http: httpx.Client) -> None:
    for path in ("/docs", "/openapi.json", "/redoc"):
        resp = http.get(path)
        assert resp.status_code == 404
        assert resp.json()["error"]["message"] == f"no route GET {path}"
    preflight = http.options(
        "/v1/chat/completions",
        headers={"Origin": "http://app.example", "Access-Control-Request-Method": "POST"},
    )
    assert preflight.status_code == 405
    assert "access-control-allow-origin" not in preflight.headers
    simple = http.get("/v1/models", headers={"Origin": "http://app.example"})
    assert simple.status_code == 200 and "access-control-allow-origin" not in simple.headers


def test_a_non_streaming_request_past_the_deadline_gets_504(server: LiveServer) -> None:
    with (
        _openai(server) as client,
        pytest.raises(openai.InternalServerError) as info,
    ):
        client.chat.completions.create(
            model="default",
            messages=LONG["messages"],
            max_tokens=900,
            extra_body={"ignore_eos": True},
        )
    assert info.value.status_code == 504
    assert info.value.body == OPENAI_TIMEOUT


def test_a_stream_past_the_deadline_ends_with_an_error_event_then_done(
    server: LiveServer, http: httpx.Client
) -> None:
    with http.stream(
        "POST",
        "/v1/chat/completions",
        json={**LONG, "stream": True},
        headers={"x-request-id": "t-stream"},
    ) as resp:
        assert resp.status_code == 200
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["message"] == TIMEOUT_MESSAGE
    # typed as the same request's 504 is when it is not streamed
    assert (error["type"], error["code"]) == ("timeout_error", "request_timeout")
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert chunks and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert not any(c["choices"][0]["finish_reason"] for c in chunks)  # it never finished

    with (
        _openai(server) as client,
        pytest.raises(openai.APIError) as info,
    ):
        stream = client.chat.completions.create(
            model="default",
            messages=LONG["messages"],
            max_tokens=900,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for _ in stream:
            pass
    assert TIMEOUT_MESSAGE in str(info.value.body)


def test_a_stream_past_the_deadline_is_the_schedulers_cut_and_reconciles_with_the_log(
    server: LiveServer, http: httpx.Client
) -> None:
    """Read by the client contract's strict consumer, the deadline's error event is the
    scheduler's cancellation carrying the server's usage of what it generated (the request
    asked for usage); it equals the access log's line, and covers every token received."""
    model = http.get("/v1/models").json()["data"][0]["id"]
    body = {**LONG, "model": model, "stream": True, "stream_options": {"include_usage": True}}
    consumer = StreamConsumer(Expectation(model, LONG["max_tokens"], require_usage=True))
    with http.stream(
        "POST", "/v1/chat/completions", json=body, headers={"x-request-id": "t-contract"}
    ) as resp:
        assert resp.status_code == 200
        for data in resp.iter_raw():
            consumer.feed(data)
    outcome = consumer.finish()
    assert isinstance(outcome, SchedulerCancelled) and outcome.code == "request_timeout", outcome
    assert outcome.usage is not None and outcome.usage_source is UsageSource.SERVER
    assert outcome.tokens_received is not None
    assert 0 < outcome.tokens_received <= outcome.usage.completion_tokens < LONG["max_tokens"]
    line = _end_line(server, "t-contract")
    fields = dict(part.split("=", 1) for part in line.split(" ")[2:])
    record = ServerRecord(
        "t-contract",
        int(fields["status"]),
        fields["outcome"],
        fields.get("error"),
        int(fields["prompt_tokens"]),
        int(fields["completion_tokens"]),
    )
    reconciled = reconcile(outcome, record, LONG["max_tokens"])
    assert reconciled.consistent and reconciled.undelivered == 0, reconciled.problems
    assert record.prompt_tokens == outcome.usage.prompt_tokens


def _end_line(server: LiveServer, request_id: str) -> str:
    """The text access log's request_end line for ``request_id``, once it is written."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for line in server.log.read_text().splitlines():
            if " request_end " in line and f"request_id={request_id} " in line:
                return line
        time.sleep(0.1)
    raise AssertionError(f"no request_end line for {request_id}")


@pytest.mark.parametrize("anthropic_caller", [False, True])
def test_a_body_that_never_arrives_gets_408(server: LiveServer, anthropic_caller: bool) -> None:
    port = int(server.url.rsplit(":", 1)[1])
    extra = "anthropic-version: 2023-06-01\r\n" if anthropic_caller else ""
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        "Content-Type: application/json\r\n"
        f"Authorization: Bearer {ENV_KEYS[0]}\r\n{extra}Content-Length: 100\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head.encode() + b'{"messages": [')
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    status_line, _, rest = reply.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 408 Request Timeout"
    body = json.loads(rest.split(b"\r\n\r\n", 1)[1])
    message = "the request timed out after 4s (--request-timeout) while sending the request body"
    if anthropic_caller:
        assert _without_request_id(body) == {
            "type": "error",
            "error": {"type": "timeout_error", "message": message},
        }
    else:
        assert body["error"]["message"] == message and body["error"]["type"] == "timeout_error"


def test_a_completion_past_the_deadline_gets_504_or_an_error_event(
    server: LiveServer, http: httpx.Client
) -> None:
    with _openai(server) as client, pytest.raises(openai.InternalServerError) as info:
        client.completions.create(
            model="default",
            prompt="Once upon a time, by the sea,",
            max_tokens=900,
            extra_body={"ignore_eos": True},
        )
    assert info.value.status_code == 504
    assert info.value.body == OPENAI_TIMEOUT

    body = {"prompt": "Once upon a time, by the sea,", "max_tokens": 900, "ignore_eos": True}
    with http.stream(
        "POST",
        "/v1/completions",
        json={**body, "stream": True},
        headers={"x-request-id": "t-cmpl-stream"},
    ) as resp:
        assert resp.status_code == 200
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert (error["message"], error["type"], error["code"]) == (
        TIMEOUT_MESSAGE,
        "timeout_error",
        "request_timeout",
    )
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert chunks and all(c["object"] == "text_completion" for c in chunks)
    assert not any(c["choices"][0]["finish_reason"] for c in chunks)  # it never finished


def test_a_message_past_the_deadline_gets_504_in_anthropics_envelope(server: LiveServer) -> None:
    with (
        _anthropic(server, ENV_KEYS[1]) as client,
        pytest.raises(anthropic.InternalServerError) as info,
    ):
        client.messages.create(
            model="default", max_tokens=900, messages=REPEAT, extra_body={"temperature": 0}
        )
    assert info.value.status_code == 504
    assert _without_request_id(info.value.body) == ANTHROPIC_TIMEOUT


def test_a_message_stream_past_the_deadline_ends_with_an_error_event(
    server: LiveServer, http: httpx.Client
) -> None:
    body = {"model": "default", "max_tokens": 900, "messages": REPEAT, "temperature": 0}
    headers = {"x-request-id": "t-msg-stream", "anthropic-version": "2023-06-01"}
    with http.stream(
        "POST", "/v1/messages", json={**body, "stream": True}, headers=headers
    ) as resp:
        assert resp.status_code == 200
        lines = list(resp.iter_lines())
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names[:2] == ["message_start", "content_block_start"]
    assert "content_block_delta" in names
    assert names[-1] == "error" and data[-1] == ANTHROPIC_TIMEOUT | {"request_id": "t-msg-stream"}
    assert "message_stop" not in names and "message_delta" not in names

    with (
        _anthropic(server, ENV_KEYS[0]) as client,
        pytest.raises(anthropic.APIStatusError) as info,
        client.messages.stream(
            model="default", max_tokens=900, messages=REPEAT, extra_body={"temperature": 0}
        ) as stream,
    ):
        for _ in stream:
            pass
    assert _without_request_id(info.value.body) == ANTHROPIC_TIMEOUT


def test_timeouts_are_logged_counted_and_free_their_kv_blocks(
    server: LiveServer, http: httpx.Client
) -> None:
    route = 'route="/v1/chat/completions"'
    assert metric(http, f"inferd_request_timeouts_total{{{route}}}") >= 3
    model = http.get("/v1/models").json()["data"][0]["id"]
    deadline = time.monotonic() + 30  # a leaked request would hold its blocks for minutes
    while metric(http, f'inferd_kv_blocks_used{{model="{model}"}}') and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(http, f'inferd_kv_blocks_used{{model="{model}"}}') == 0
    assert metric(http, f'inferd_requests_running{{model="{model}"}}') == 0
    ends = [
        line
        for line in server.log.read_text().splitlines()
        if " request_end " in line and "request_id=t-stream " in line
    ]
    assert len(ends) == 1
    fields = dict(part.split("=", 1) for part in ends[0].split(" ")[2:])
    assert fields["route"] == "/v1/chat/completions" and fields["status"] == "200"
    assert fields["outcome"] == "error" and fields["error"] == "timeout"
    assert 0 < int(fields["completion_tokens"]) < 900
    for route, request_id in (
        ("/v1/completions", "t-cmpl-stream"),
        ("/v1/messages", "t-msg-stream"),
    ):
        assert metric(http, f'inferd_request_timeouts_total{{route="{route}"}}') >= 2
        ends = [
            line
            for line in server.log.read_text().splitlines()
            if " request_end " in line and f"request_id={request_id} " in line
        ]
        assert len(ends) == 1
        fields = dict(part.split("=", 1) for part in ends[0].split(" ")[2:])
        assert fields["route"] == route and fields["status"] == "200"
        assert fields["outcome"] == "error" and fields["error"] == "timeout"
        assert fields["model"] == model
        assert 0 < int(fields["completion_tokens"]) < 900
    assert http.get("/health").json() == {"status": "ok"}
