"""/v1/chat/completions parameters beyond the basics: n, seeds, logprobs, logit_bias, penalties,
and the parameters OpenAI knows that this server refuses by name. Real server, strict SDK."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest

from tests.server.live import LiveServer

ASK = [{"role": "user", "content": "Name a fruit and describe it."}]


def test_n_seeded_choices_differ_and_reproduce(client: openai.OpenAI, model: str) -> None:
    def run() -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(
            model=model, messages=ASK, n=3, seed=5, temperature=1.0, max_tokens=8
        )

    first, again = run(), run()
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len(set(texts)) == 3, texts
    assert [c.message.content for c in again.choices] == texts
    single = client.chat.completions.create(
        model=model, messages=ASK, seed=5, temperature=1.0, max_tokens=8
    )
    assert single.choices[0].message.content == texts[0]  # choice 0 keeps the request's seed
    assert first.usage is not None and single.usage is not None
    assert first.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once
    assert 3 <= first.usage.completion_tokens <= 24
    if all(c.finish_reason == "length" for c in first.choices):
        assert first.usage.completion_tokens == 24


def test_n_streaming_matches_non_streaming(client: openai.OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = {
        "model": model,
        "messages": ASK,
        "n": 2,
        "seed": 9,
        "temperature": 0.8,
        "max_tokens": 6,
    }
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    texts = {0: "", 1: ""}
    roles = {0: 0, 1: 0}
    finishes: dict[int, list[str]] = {0: [], 1: []}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        roles[choice.index] += choice.delta.role == "assistant"
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
    assert roles == {0: 1, 1: 1}
    assert [texts[0], texts[1]] == [c.message.content for c in full.choices]
    assert finishes == {i: [full.choices[i].finish_reason] for i in (0, 1)}
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_logprobs_follow_the_tokens_of_a_greedy_answer(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(
        model=model, messages=ASK, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3
    )
    choice = out.choices[0]
    assert choice.finish_reason == "length" and out.usage is not None
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert len(content) == out.usage.completion_tokens == 6
    assert "".join(t.token for t in content) == choice.message.content
    for token in content:
        assert token.logprob <= 0 and token.bytes == list(token.token.encode())
        assert len(token.top_logprobs) == 3
        values = [t.logprob for t in token.top_logprobs]
        assert values == sorted(values, reverse=True)
        # greedy without penalties picks the most likely token of the raw distribution
        assert token.top_logprobs[0].token == token.token
        assert token.top_logprobs[0].logprob == token.logprob
        assert sum(2.718281828459045**v for v in values) <= 1.0 + 1e-5

    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=ASK,
            temperature=0,
            max_tokens=6,
            logprobs=True,
            top_logprobs=3,
            stream=True,
        )
    )
    streamed = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.content
        for t in c.choices[0].logprobs.content
    ]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]


def test_logprobs_leave_out_the_end_of_turn_token(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hi."}],
        temperature=0,
        max_tokens=30,
        logprobs=True,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and out.usage is not None
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert len(choice.logprobs.content) == out.usage.completion_tokens - 1
    assert "".join(t.token for t in choice.logprobs.content) == choice.message.content


def test_logprobs_are_null_unless_asked_and_zero_top_is_empty(
    client: openai.OpenAI, model: str
) -> None:
    plain = client.chat.completions.create(model=model, messages=ASK, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None
    bare = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=2, temperature=0, logprobs=True
    )
    lps = bare.choices[0].logprobs
    assert lps is not None and lps.content is not None and len(lps.content) == 2
    assert all(t.top_logprobs == [] for t in lps.content)


def test_logit_bias_forces_and_bans_tokens(
    client: openai.OpenAI, model: str, server: LiveServer
) -> None:
    (bang,) = httpx.post(server.url + "/tokenize", json={"prompt": "!"}).json()["tokens"]
    forced = client.chat.completions.create(
        model=model, messages=ASK, temperature=0, max_tokens=4, logit_bias={str(bang): 100}
    )
    assert forced.choices[0].message.content == "!!!!"

    base = client.chat.completions.create(
        model=model, messages=ASK, temperature=0, max_tokens=1, logprobs=True
    )
    first = base.choices[0].logprobs.content[0].token  # type: ignore[union-attr,index]
    (first_id,) = httpx.post(server.url + "/tokenize", json={"prompt": first}).json()["tokens"]
    banned = client.chat.completions.create(
        model=model, messages=ASK, temperature=0, max_tokens=1, logit_bias={str(first_id): -100}
    )
    assert banned.choices[0].message.content not in ("", first)


def test_ignore_eos_runs_to_max_tokens(client: openai.OpenAI, model: str) -> None:
    hi = [{"role": "user", "content": "Say hi."}]
    short = client.chat.completions.create(model=model, messages=hi, temperature=0, max_tokens=30)
    assert short.choices[0].finish_reason == "stop"
    assert short.usage is not None and short.usage.completion_tokens < 30
    long = client.chat.completions.create(
        model=model,
        messages=hi,
        temperature=0,
        max_tokens=30,
        extra_body={"ignore_eos": True},
    )
    assert long.choices[0].finish_reason == "length"
    assert long.usage is not None and long.usage.completion_tokens == 30


def test_accepted_extras_and_unknown_fields_are_ignored(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(
        model=model,
        messages=ASK,
        temperature=0,
        max_completion_tokens=3,
        user="someone",
        metadata={"team": "a"},
        store=False,
        stop="zzz",
        tool_choice="none",
        response_format={"type": "text"},
        modalities=["text"],
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={"repetition_penalty": 1.1, "no_such_field": {"x": 1}, "top_k": -1},
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 3


_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

REFUSED = [
    ("tool_choice without tools", {"tool_choice": "auto"}, "tool_choice", "offers no tools"),
    ("functions", {"functions": [{"name": "f"}]}, "functions", "function calling"),
    ("function_call", {"function_call": "auto"}, "function_call", "use tools"),
    (
        "json_schema typo",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "proprties": {}}},
            }
        },
        "response_format.json_schema.schema",
        "unknown keyword 'proprties'",
    ),
    ("format type", {"response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
    ("audio", {"audio": {"voice": "alloy", "format": "wav"}}, "audio", "audio output"),
    ("modalities", {"modalities": ["text", "audio"]}, "modalities", "audio"),
    ("prediction", {"prediction": {"type": "content", "content": "x"}}, "prediction", "predicted"),
    ("web search", {"web_search_options": {}}, "web_search_options", "web search"),
    ("top_logprobs alone", {"top_logprobs": 2}, "top_logprobs", "requires logprobs"),
    (
        "top_logprobs 21",
        {"logprobs": True, "top_logprobs": 21},
        "top_logprobs",
        "top_logprobs must be between 0 and 20",
    ),
    ("n zero", {"n": 0}, "n", "between 1 and 16"),
    ("n too many", {"n": 17}, "n", "between 1 and 16"),
    ("bias key", {"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ("bias id", {"logit_bias": {"999999": 1}}, "logit_bias", "outside this model's vocabulary"),
    ("bias value", {"logit_bias": {"5": 150}}, "logit_bias", "between -100 and 100"),
    ("presence", {"presence_penalty": 3}, "presence_penalty", "between -2 and 2"),
    ("frequency", {"frequency_penalty": -2.5}, "frequency_penalty", "between -2 and 2"),
    ("repetition", {"repetition_penalty": 0}, "repetition_penalty", "(0, 10]"),
    ("seed", {"seed": 2**70}, "seed", "64-bit"),
    (
        "max tokens disagree",
        {"max_tokens": 3, "max_completion_tokens": 4},
        "max_completion_tokens",
        "disagree",
    ),
]


@pytest.mark.parametrize(("name", "extra", "param", "needle"), REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_parameters_are_named(
    server: LiveServer, name: str, extra: dict[str, Any], param: str, needle: str
) -> None:
    body = {"messages": ASK, "max_tokens": 2} | extra
    r = httpx.post(server.api + "/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert needle in err["message"]


def test_the_sdk_raises_bad_request_for_an_unknown_tool_choice(
    client: openai.OpenAI, model: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model,
            messages=ASK,
            max_tokens=2,
            tools=[_TOOL],  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "g"}},
        )
    assert info.value.status_code == 400
    assert info.value.param == "tool_choice"


STORY = [{"role": "user", "content": "Write a very long story about a lighthouse keeper."}]


@pytest.mark.parametrize(
    ("path", "body", "running"),
    [
        ("/v1/chat/completions", {"messages": STORY, "n": 2, "ignore_eos": True}, 2),
        ("/v1/completions", {"prompt": ["Once", "upon"], "n": 1, "ignore_eos": True}, 2),
        ("/v1/messages", {"model": "default", "messages": STORY}, 1),
    ],
    ids=["chat n=2", "completions 2 prompts", "anthropic"],
)
def test_leaving_a_stream_aborts_every_choice(
    server: LiveServer, path: str, body: dict[str, Any], running: int
) -> None:
    before = server.metric("inferd_generation_tokens_total")
    body = body | {"max_tokens": 1000, "temperature": 0, "stream": True}
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", server.url + path, json=body) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.iter_lines()  # kept open: breaking out of a for loop would close it
        data = 0
        while data < 8:
            data += next(lines).startswith("data: ")
        assert server.metric("inferd_requests_running") == running
    deadline = time.monotonic() + 15
    while server.metric("inferd_requests_running") or server.metric("inferd_kv_blocks_used"):
        assert time.monotonic() < deadline, "an abandoned choice kept running"
        time.sleep(0.1)
    assert server.metric("inferd_generation_tokens_total") - before < running * 1000
