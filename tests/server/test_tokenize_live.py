"""/v1/models/{id}, /tokenize and /detokenize on the real server."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.server.live import LiveServer

HI = [{"role": "user", "content": "Hello there!"}]


def test_retrieve_model(client: openai.OpenAI, model: str, server: LiveServer) -> None:
    card = client.models.retrieve(model)
    assert card.id == model and card.object == "model" and card.owned_by == "inferd"
    assert httpx.get(f"{server.url}/models/{model}").json()["id"] == model
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body == {
        "message": f"the model 'no-such-model' does not exist on this server; available: {model}",
        "type": "not_found_error",
        "param": "model",
        "code": "model_not_found",
    }


def test_tokenize_roundtrip_with_pieces(server: LiveServer) -> None:
    text = "Hello wörld, 1234!"
    r = httpx.post(server.url + "/tokenize", json={"prompt": text, "return_token_strs": True})
    assert r.status_code == 200
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == 2048
    assert "".join(body["token_strs"]) == text
    back = httpx.post(server.url + "/detokenize", json={"tokens": body["tokens"]}).json()
    assert back == {"prompt": text}
    plain = httpx.post(server.api + "/tokenize", json={"prompt": text}).json()
    assert plain["tokens"] == body["tokens"] and plain["token_strs"] is None


def test_tokenize_messages_counts_like_chat(
    server: LiveServer, client: openai.OpenAI, model: str
) -> None:
    counted = httpx.post(server.url + "/tokenize", json={"messages": HI}).json()
    chat = client.chat.completions.create(model=model, messages=HI, max_tokens=1)  # type: ignore[arg-type]
    assert chat.usage is not None and counted["count"] == chat.usage.prompt_tokens
    bare = httpx.post(
        server.url + "/tokenize", json={"messages": HI, "add_generation_prompt": False}
    ).json()
    assert bare["count"] < counted["count"]
    assert counted["tokens"][: bare["count"]] == bare["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": counted["tokens"]}).json()
    assert "Hello there!" in text["prompt"]


ERRORS: list[tuple[str, str, dict[str, Any], str, str]] = [
    ("both", "/tokenize", {"prompt": "a", "messages": HI}, "prompt", "exactly one"),
    ("neither", "/tokenize", {}, "prompt", "exactly one"),
    ("empty messages", "/tokenize", {"messages": []}, "messages", "at least one message"),
    (
        "bad role",
        "/tokenize",
        {"messages": [{"role": "x", "content": "a"}]},
        "messages.0.role",
        "role",
    ),
    ("out of range", "/detokenize", {"tokens": [1, 10**6]}, "tokens.1", "outside"),
    ("not ids", "/detokenize", {"tokens": ["a"]}, "tokens.0", "integer"),
    ("missing", "/detokenize", {}, "tokens", "required"),
    ("model", "/detokenize", {"tokens": [1], "model": "nope"}, "model", "does not exist"),
]


@pytest.mark.parametrize(
    ("name", "path", "body", "param", "needle"), ERRORS, ids=[e[0] for e in ERRORS]
)
def test_bad_tokenizer_requests(
    server: LiveServer, name: str, path: str, body: dict[str, Any], param: str, needle: str
) -> None:
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == (404 if name == "model" else 400), r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"]


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(server: LiveServer) -> None:
    """Bounded as the generating routes are (a 15 MB prompt here once stalled every request,
    /health too, for seconds): characters the context cannot hold are a 400 naming the field."""
    text = "hello world " * 50_000  # 600k characters: at least 7.4k tokens, past 2048
    anthropic = {"anthropic-version": "2023-06-01"}
    for path, body, param in (
        ("/v1/tokenize", {"prompt": text}, "prompt"),
        ("/v1/tokenize", {"messages": [{"role": "user", "content": text}]}, "messages"),
        (
            "/v1/messages/count_tokens",
            {"model": "default", "messages": [{"role": "user", "content": text}]},
            "messages",
        ),
    ):
        r = httpx.post(server.url + path, json=body, headers=anthropic, timeout=60)
        assert r.status_code == 400, r.text[:300]
        error = r.json()["error"]
        assert error["message"].startswith(f"{param}: the prompt is "), error
        assert "this model's context is 2048 tokens" in error["message"], error
        if path == "/v1/tokenize":
            assert error["param"] == param and error["code"] == "context_length_exceeded"
    # one that may fit is still counted, even past the context
    r = httpx.post(server.url + "/tokenize", json={"prompt": "hello world " * 2000}, timeout=60)
    assert r.status_code == 200 and r.json()["count"] > 2048
