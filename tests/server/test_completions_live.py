"""/v1/completions on the real server with the openai SDK, streaming and not, plus errors.

The SDK's ``Completion`` type declares ``finish_reason`` non-null, yet OpenAI's own streams
send null until the last chunk of each choice; streamed completions are therefore read with a
non-strict client and their chunks checked here by hand. Likewise ``echo`` with ``logprobs``
gives the first prompt token a null logprob, as OpenAI does, which the SDK's types do not allow;
those responses are read with httpx. Everything else is strict.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from tests.server.live import LiveServer

PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def lax_client(server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0) as c:
        yield c


def _ids(server: LiveServer, text: str) -> list[int]:
    return list(httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["tokens"])


def test_string_prompt_streaming_and_not_agree(
    client: openai.OpenAI, lax_client: openai.OpenAI, model: str
) -> None:
    full = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=8)
    assert full.object == "text_completion" and full.id.startswith("cmpl-")
    (choice,) = full.choices
    assert choice.index == 0 and choice.text and choice.logprobs is None
    assert choice.finish_reason == "length"
    assert full.usage is not None and full.usage.completion_tokens == 8
    assert full.usage.total_tokens == full.usage.prompt_tokens + 8

    chunks = list(
        lax_client.completions.create(
            model=model,
            prompt=PROMPT,
            temperature=0,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *body, last = chunks
    assert "".join(c.choices[0].text for c in body) == choice.text
    assert [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason] == ["length"]
    assert body[-1].choices[0].finish_reason == "length"
    assert all(c.object == "text_completion" and c.id == body[0].id for c in body)
    assert all(c.usage is None for c in body)
    assert last.choices == [] and last.usage == full.usage


def test_default_max_tokens_is_sixteen(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(
        model=model, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage is not None and out.usage.completion_tokens == 16


def test_prompt_shapes_give_the_same_text(
    client: openai.OpenAI, model: str, server: LiveServer
) -> None:
    ids = _ids(server, PROMPT)
    other = "One, two, three,"
    texts = client.completions.create(
        model=model, prompt=[PROMPT, other], temperature=0, max_tokens=5
    )
    by_ids = client.completions.create(model=model, prompt=ids, temperature=0, max_tokens=5)
    by_lists = client.completions.create(
        model=model, prompt=[ids, _ids(server, other)], temperature=0, max_tokens=5
    )
    assert [c.index for c in texts.choices] == [0, 1]
    assert by_ids.choices[0].text == texts.choices[0].text
    assert [c.text for c in by_lists.choices] == [c.text for c in texts.choices]
    assert texts.usage is not None and by_lists.usage is not None
    assert texts.usage.prompt_tokens == len(ids) + len(_ids(server, other))
    assert by_lists.usage == texts.usage


def test_n_choices_are_prompt_major_and_seeded(client: openai.OpenAI, model: str) -> None:
    def run() -> list[str]:
        out = client.completions.create(
            model=model,
            prompt=["My favourite animal is the", "My favourite city is"],
            n=2,
            seed=5,
            temperature=1.0,
            max_tokens=6,
        )
        assert [c.index for c in out.choices] == [0, 1, 2, 3]
        return [c.text for c in out.choices]

    texts = run()
    assert texts == run()
    assert texts[0] != texts[1] and texts[2] != texts[3]


def test_echo_prepends_the_prompt(client: openai.OpenAI, model: str, server: LiveServer) -> None:
    plain = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=4)
    echoed = client.completions.create(
        model=model, prompt=PROMPT, temperature=0, max_tokens=4, echo=True
    )
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    by_ids = client.completions.create(
        model=model, prompt=_ids(server, PROMPT), temperature=0, max_tokens=4, echo=True
    )
    assert by_ids.choices[0].text == echoed.choices[0].text


def test_logprobs_line_up_with_the_text(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(
        model=model, prompt=PROMPT, temperature=0, max_tokens=6, logprobs=2
    )
    choice = out.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and len(top) == 2
        assert top[token] == value == max(top.values())  # greedy: the best token, included


def test_streamed_logprobs_match(
    lax_client: openai.OpenAI, client: openai.OpenAI, model: str
) -> None:
    kwargs: dict[str, Any] = {
        "model": model,
        "prompt": PROMPT,
        "temperature": 0,
        "max_tokens": 5,
        "logprobs": 1,
    }
    full = client.completions.create(**kwargs).choices[0].logprobs
    assert full is not None
    tokens: list[str] = []
    offsets: list[int] = []
    for chunk in lax_client.completions.create(**kwargs, stream=True):
        lp = chunk.choices[0].logprobs
        if lp is not None:
            tokens += lp.tokens or []
            offsets += lp.text_offset or []
    assert tokens == full.tokens and offsets == full.text_offset


def test_stop_and_penalties(client: openai.OpenAI, model: str) -> None:
    def tokens(**kwargs: Any) -> list[str]:
        out = client.completions.create(
            model=model,
            prompt="apple apple apple apple apple",
            temperature=0,
            max_tokens=8,
            logprobs=0,
            **kwargs,
        )
        lp = out.choices[0].logprobs
        assert lp is not None and lp.tokens is not None
        return lp.tokens

    base = tokens()
    assert base.count("-") >= 4  # greedy keeps repeating the dash
    for penalty in (
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"extra_body": {"repetition_penalty": 2.0}},
    ):
        assert tokens(**penalty).count("-") < base.count("-"), penalty

    text = "".join(base)
    stop = base[1]
    out = client.completions.create(
        model=model,
        prompt="apple apple apple apple apple",
        temperature=0,
        max_tokens=8,
        stop=stop,
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[: text.index(stop)]


def test_n_streaming_gives_each_choice_one_finish(lax_client: openai.OpenAI, model: str) -> None:
    chunks = list(
        lax_client.completions.create(
            model=model,
            prompt=[PROMPT, "Once upon a time"],
            n=2,
            temperature=0,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    finishes = [c.choices[0].index for c in chunks[:-1] if c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1, 2, 3]
    texts = [
        "".join(c.choices[0].text for c in chunks[:-1] if c.choices[0].index == i) for i in range(4)
    ]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: n copies agree
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16


SCORED = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting each of "
    "the one hundred and twelve steps, listening to the wind and the gulls and the sea. "
) * 20  # over 512 tokens: more than one prefill chunk (--max-num-batched-tokens)


def _post(server: LiveServer, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(server.api + "/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _streamed(server: LiveServer, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream(
        "POST", server.api + "/completions", json={**body, "stream": True}, timeout=300
    ) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def _assert_same_logprobs(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Equal legacy logprobs, values within 1e-3 (batching may move the last bits)."""
    assert a["tokens"] == b["tokens"] and a["text_offset"] == b["text_offset"]
    for x, y in zip(a["token_logprobs"], b["token_logprobs"], strict=True):
        assert (x is None and y is None) or abs(x - y) < 1e-3
    for x, y in zip(a["top_logprobs"], b["top_logprobs"], strict=True):
        assert (x is None and y is None) or (
            x.keys() == y.keys() and all(abs(x[k] - y[k]) < 1e-3 for k in x)
        )


def test_echo_with_logprobs_scores_the_prompt_like_transformers(
    server: LiveServer, model: str, hf_smollm2: Any
) -> None:
    ids = _ids(server, SCORED)
    assert len(ids) > 512
    body = {
        "model": model,
        "prompt": SCORED,
        "echo": True,
        "logprobs": 2,
        "max_tokens": 4,
        "temperature": 0,
    }
    out = _post(server, body)
    (choice,) = out["choices"]
    lp = choice["logprobs"]
    n = len(ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + 4
    assert "".join(lp["tokens"]) == choice["text"] and choice["text"].startswith(SCORED)
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(n + 4)]
    assert lp["text_offset"] == offsets
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    with torch.inference_mode():
        logits = hf_smollm2(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    for i in range(1, n):
        expected = float(ref[i - 1, ids[i]])
        assert abs(lp["token_logprobs"][i] - expected) < 1e-3, (i, expected)
        top = lp["top_logprobs"][i]
        assert top[lp["tokens"][i]] == lp["token_logprobs"][i]  # the prompt token is included
        best = ref[i - 1].topk(2).values.tolist()
        assert all(any(abs(v - b) < 1e-3 for v in top.values()) for b in best)
    # The completion part is exactly what the same request without echo returns.
    plain = _post(server, {**body, "echo": False})["choices"][0]
    assert choice["text"] == SCORED + plain["text"]
    shifted = [o + len(SCORED) for o in plain["logprobs"]["text_offset"]]
    _assert_same_logprobs(
        {k: v[n:] for k, v in lp.items()}, plain["logprobs"] | {"text_offset": shifted}
    )
    assert out["usage"]["prompt_tokens"] == n and out["usage"]["completion_tokens"] == 4

    chunks = _streamed(server, body)
    assert all(c["object"] == "text_completion" for c in chunks)
    merged: dict[str, list[Any]] = {k: [] for k in lp}
    for c in chunks:
        if c["choices"][0]["logprobs"] is not None:
            for key in merged:
                merged[key] += c["choices"][0]["logprobs"][key]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert chunks[0]["choices"][0]["text"] == SCORED  # the echo, with the prompt's logprobs
    assert len(chunks[0]["choices"][0]["logprobs"]["tokens"]) == n
    _assert_same_logprobs(merged, lp)


def test_echo_with_logprobs_for_several_prompts_and_choices(server: LiveServer, model: str) -> None:
    prompts = [PROMPT, "One, two, three,"]
    out = _post(
        server,
        {
            "model": model,
            "prompt": prompts,
            "n": 2,
            "echo": True,
            "logprobs": 0,
            "max_tokens": 3,
            "temperature": 0,
        },
    )
    choices = out["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for c in choices:
        prompt = prompts[c["index"] // 2]
        n = len(_ids(server, prompt))
        lp = c["logprobs"]
        assert "".join(lp["tokens"][:n]) == prompt and c["text"].startswith(prompt)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(v <= 0 for v in lp["token_logprobs"][1:])
        assert all(len(top) == 1 for top in lp["top_logprobs"][1:])  # logprobs=0: the token
    _assert_same_logprobs(choices[0]["logprobs"], choices[1]["logprobs"])  # greedy: n agree
    _assert_same_logprobs(choices[2]["logprobs"], choices[3]["logprobs"])


TOO_LONG = "word " * 2100

ERRORS = [
    ("missing prompt", {}, 400, "prompt", "prompt is required"),
    ("empty list", {"prompt": []}, 400, "prompt", "got an empty list"),
    ("number", {"prompt": 5}, 400, "prompt", "got int"),
    ("mixed list", {"prompt": ["a", 1]}, 400, "prompt", "a list of token-id lists"),
    ("bad id", {"prompt": [1, 99999]}, 400, "prompt", "token id 99999 is outside"),
    ("bad nested id", {"prompt": [[1], [-1]]}, 400, "prompt.1", "token id -1 is outside"),
    ("empty ids", {"prompt": [[]]}, 400, "prompt", "empty after tokenization"),
    ("suffix", {"prompt": "a", "suffix": "b"}, 400, "suffix", "fill-in-the-middle"),
    ("logprobs 21", {"prompt": "a", "logprobs": 21}, 400, "logprobs", "between 0 and 20"),
    ("n zero", {"prompt": "a", "n": 0}, 400, "n", "between 1 and 16"),
    ("too many choices", {"prompt": ["a"] * 5, "n": 16}, 400, "n", "at most 64"),
    ("best_of", {"prompt": "a", "best_of": 3}, 400, "best_of", "best_of=3"),
    ("max_tokens zero", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    (
        "stream_options",
        {"prompt": "a", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        "only allowed when stream is true",
    ),
    ("overflow", {"prompt": TOO_LONG, "max_tokens": 50}, 400, "max_tokens", "2048"),
    ("unknown model", {"prompt": "a", "model": "nope"}, 404, "model", "does not exist"),
    ("temperature", {"prompt": "a", "temperature": 3}, 400, "temperature", "between 0 and 2"),
]


@pytest.mark.parametrize(
    ("name", "body", "status", "param", "needle"), ERRORS, ids=[e[0] for e in ERRORS]
)
def test_bad_completion_requests(
    server: LiveServer, name: str, body: dict[str, Any], status: int, param: str, needle: str
) -> None:
    r = httpx.post(server.api + "/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    assert needle in err["message"]


def test_sdk_error_for_suffix(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="def f(", suffix="return 1", max_tokens=2)
    assert info.value.param == "suffix"
