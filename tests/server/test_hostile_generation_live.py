"""Hostile and careless generation requests against the live server (issue 10, items 3 and 4):
tiny temperatures, and `echo` + `logprobs` + `n` amplification."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai

from tests.server.live import LiveServer

PROMPT = "The three primary colors are"


def _completion(server: LiveServer, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(server.api + "/completions", json=body, headers=headers, timeout=300)


def _assert_idle(server: LiveServer) -> None:
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert server.metric("inferd_kv_blocks_used") == 0
    assert server.metric("inferd_requests_running") == 0


def test_tiny_temperatures_answer_greedily(client: openai.OpenAI, model: str) -> None:
    # 1e-40 used to overflow the logits and return the last vocabulary id as every token.
    greedy = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=12)
    for temperature in (1e-40, 5e-324, 9.9e-6):
        tiny = client.completions.create(
            model=model, prompt=PROMPT, temperature=temperature, max_tokens=12, seed=1
        )
        assert tiny.choices[0].text == greedy.choices[0].text
    messages: Any = [{"role": "user", "content": "Name a color."}]
    chat = [
        client.chat.completions.create(model=model, messages=messages, temperature=t, max_tokens=10)
        .choices[0]
        .message.content
        for t in (0, 1e-40)
    ]
    assert chat[0] == chat[1]


def test_echo_logprobs_and_n_beyond_the_response_bound_get_400(
    server: LiveServer, model: str
) -> None:
    # ~1,500 prompt tokens x 16 choices x 21 (token, logprob) pairs: over 500k pairs.
    body = {
        "model": model,
        "prompt": "word " * 1500,
        "echo": True,
        "logprobs": 20,
        "n": 16,
        "max_tokens": 16,
    }
    r = _completion(server, body, **{"x-request-id": "hostile-echo-1"})
    assert r.status_code == 400, r.text
    assert r.headers["x-request-id"] == "hostile-echo-1"
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "logprobs"
    assert "--max-logprobs-tokens" in error["message"] and "n=16" in error["message"]
    _assert_idle(server)
    # An honest request with the same shape, smaller, still runs.
    ok = _completion(server, body | {"prompt": PROMPT, "n": 2, "logprobs": 2, "max_tokens": 3})
    assert ok.status_code == 200, ok.text
    _assert_idle(server)


def test_every_choice_repeats_the_prompt_scores_streamed_and_not(
    server: LiveServer, model: str
) -> None:
    body = {
        "model": model,
        "prompt": PROMPT,
        "echo": True,
        "logprobs": 1,
        "n": 3,
        "max_tokens": 4,
        "temperature": 0.8,
        "seed": 5,
    }
    n = len(httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"])
    full = _completion(server, body).json()["choices"]
    prompt_scores = [c["logprobs"]["token_logprobs"][:n] for c in full]
    assert prompt_scores[0][0] is None and all(s == prompt_scores[0] for s in prompt_scores)
    with httpx.stream(
        "POST", server.api + "/completions", json=body | {"stream": True}, timeout=300
    ) as r:
        assert r.status_code == 200
        events = [
            line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: {")
        ]
    firsts: dict[int, dict[str, Any]] = {}
    for event in events:
        (choice,) = json.loads(event)["choices"]
        firsts.setdefault(choice["index"], choice)
    assert sorted(firsts) == [0, 1, 2]
    for choice in firsts.values():  # each choice's first chunk: the echo with its scores
        assert choice["text"] == PROMPT
        assert choice["logprobs"]["token_logprobs"] == prompt_scores[0]
    _assert_idle(server)
