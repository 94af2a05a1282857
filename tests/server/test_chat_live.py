"""`inferd serve` driven by the official openai SDK in strict mode, plus raw HTTP for errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.server.live import LiveServer

QUESTION = [{"role": "user", "content": "Tell me about the moon in three sentences."}]


_clients: dict[str, openai.OpenAI] = {}


def _client(server: LiveServer) -> openai.OpenAI:
    """One strict client per server, closed when the module ends."""
    if server.api not in _clients:
        _clients[server.api] = openai.OpenAI(
            base_url=server.api, api_key="unused", max_retries=0, _strict_response_validation=True
        )
    return _clients[server.api]


@pytest.fixture(scope="module", autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    for client in _clients.values():
        client.close()
    _clients.clear()


def _async_client(server: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=server.api, api_key="unused", max_retries=0, _strict_response_validation=True
    )


def _model(server: LiveServer) -> str:
    return _client(server).models.list().data[0].id


def test_models_lists_the_loaded_model(server: LiveServer) -> None:
    body = httpx.get(server.api + "/models").json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["status"] == "loaded" and card["object"] == "model"
    assert {"id", "created", "owned_by"} <= card.keys()
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_non_streaming_and_streaming_give_the_same_text(server: LiveServer) -> None:
    client, model = _client(server), _model(server)
    full = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=40
    )
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = full.usage
    assert usage is not None and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 < usage.completion_tokens <= 40

    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=QUESTION,
            temperature=0,
            max_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.role) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == choice.finish_reason
    assert text == choice.message.content
    assert chunks[-1].choices == [] and chunks[-1].usage == usage
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_max_tokens_gives_length_and_exact_usage(server: LiveServer) -> None:
    out = _client(server).chat.completions.create(
        model=_model(server), messages=QUESTION, max_completion_tokens=5, temperature=0
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 5


def test_stop_string_is_not_in_the_output(server: LiveServer) -> None:
    client, model = _client(server), _model(server)
    base = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=40
    )
    text = base.choices[0].message.content or ""
    stop = text.split()[3]
    out = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=40, stop=[stop]
    )
    assert out.choices[0].finish_reason == "stop"
    assert stop not in (out.choices[0].message.content or "")
    assert text.startswith(out.choices[0].message.content or "")


def test_seed_reproduces_sampled_text(server: LiveServer) -> None:
    client, model = _client(server), _model(server)

    def run(seed: int) -> str | None:
        return (
            client.chat.completions.create(
                model=model,
                messages=QUESTION,
                temperature=0.9,
                top_p=0.95,
                max_tokens=20,
                seed=seed,
            )
            .choices[0]
            .message.content
        )

    assert run(11) == run(11)


def test_eight_concurrent_streams_match_their_solo_text(server: LiveServer) -> None:
    model = _model(server)
    prompts = [
        [{"role": "user", "content": f"Count to {k} in words, then stop."}] for k in range(3, 11)
    ]

    async def one(client: openai.AsyncOpenAI, messages: list[dict[str, str]]) -> str:
        stream = await client.chat.completions.create(
            model=model,
            messages=messages,
            temperature=0,
            max_tokens=24,
            stream=True,  # type: ignore[arg-type]
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def main() -> tuple[list[str], list[str]]:
        async with _async_client(server) as client:
            alone = [await one(client, p) for p in prompts]
            together = await asyncio.gather(*(one(client, p) for p in prompts))
        return alone, list(together)

    alone, together = asyncio.run(main())
    assert together == alone
    assert all(alone) and len(set(alone)) > 1


def test_client_disconnect_frees_the_request(server: LiveServer) -> None:
    body = {
        "messages": QUESTION,
        "max_tokens": 1000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    generated_before = server.metric("inferd_generation_tokens_total")
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", server.api + "/chat/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for _ in range(6):
            next(lines)
        assert server.metric("inferd_requests_running") == 1
    deadline = time.monotonic() + 15
    while server.metric("inferd_requests_running") or server.metric("inferd_kv_blocks_used"):
        assert time.monotonic() < deadline, "the abandoned request kept running"
        time.sleep(0.1)
    # Counted from before the request, so earlier tests' tokens do not decide the outcome.
    assert server.metric("inferd_generation_tokens_total") - generated_before < 1000


def test_request_id_is_echoed_or_generated(server: LiveServer) -> None:
    r = httpx.get(server.api + "/models", headers={"x-request-id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    r = httpx.get(server.api + "/models")
    assert len(r.headers["x-request-id"]) >= 16
    r = httpx.get(server.api + "/models", headers={"x-request-id": "bad id with spaces"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-request-id"


TOO_LONG = "word " * 2100

ERRORS = [
    ("invalid json", b"{not json", 400, None, "not valid JSON"),
    ("not an object", b"[1, 2]", 400, None, "JSON object"),
    ("missing messages", {"model": "default"}, 400, "messages", "required"),
    ("empty messages", {"messages": []}, 400, "messages", "at least one"),
    (
        "unknown role",
        {"messages": [{"role": "wizard", "content": "hi"}]},
        400,
        "messages.0.role",
        "unknown role",
    ),
    (
        "numeric content",
        {"messages": [{"role": "user", "content": 123}]},
        400,
        "messages.0.content",
        "string",
    ),
    (
        "image for a text model",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "data:image/png,x"}}],
                }
            ]
        },
        400,
        "messages.0.content.0",
        "does not accept image input",
    ),
    ("max_tokens zero", {"messages": QUESTION, "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    (
        "max_completion_tokens negative",
        {"messages": QUESTION, "max_completion_tokens": -3},
        400,
        "max_completion_tokens",
        "at least 1",
    ),
    (
        "temperature too high",
        {"messages": QUESTION, "temperature": 9},
        400,
        "temperature",
        "between 0 and 2",
    ),
    ("top_p zero", {"messages": QUESTION, "top_p": 0}, 400, "top_p", "top_p"),
    ("top_k negative", {"messages": QUESTION, "top_k": -2}, 400, "top_k", "top_k"),
    (
        "five stop strings",
        {"messages": QUESTION, "stop": ["a", "b", "c", "d", "e"]},
        400,
        "stop",
        "at most 4",
    ),
    ("unknown model", {"model": "nope", "messages": QUESTION}, 404, "model", "does not exist"),
    (
        "context overflow",
        {"messages": [{"role": "user", "content": TOO_LONG}], "max_tokens": 100},
        400,
        "max_tokens",
        "2048",
    ),
    (
        "stream_options without stream",
        {"messages": QUESTION, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        "stream",
    ),
    (
        "temperature as text",
        {"messages": QUESTION, "temperature": "hot"},
        400,
        "temperature",
        "number",
    ),
]


@pytest.mark.parametrize(
    ("name", "body", "status", "param", "needle"), ERRORS, ids=[e[0] for e in ERRORS]
)
def test_bad_requests_get_a_clear_openai_error(
    server: LiveServer, name: str, body: object, status: int, param: str | None, needle: str
) -> None:
    kwargs = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    r = httpx.post(server.api + "/chat/completions", timeout=30, **kwargs)  # type: ignore[arg-type]
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    assert needle.lower() in err["message"].lower()
    assert httpx.get(server.url + "/health").status_code == 200


def test_context_overflow_message_names_both_numbers(server: LiveServer) -> None:
    r = httpx.post(
        server.api + "/chat/completions",
        json={"messages": [{"role": "user", "content": TOO_LONG}], "max_tokens": 100},
    )
    message = r.json()["error"]["message"]
    assert "2048" in message and "100 max_tokens" in message


def test_unknown_route_and_wrong_method_answer_in_json(server: LiveServer) -> None:
    r = httpx.get(server.api + "/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(server.api + "/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_routes_answer_without_the_v1_prefix(server: LiveServer) -> None:
    assert httpx.get(server.url + "/models").json()["object"] == "list"
