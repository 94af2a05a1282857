"""Web search through a real `inferd serve --search-dir DIR --search-embedding-model minilm`
(the default chat model and the MiniLM embedding model, one --config), official SDK in strict
mode, greedy decoding.

The server searches for the user's last message before the model's first round (the default
model calls no tool unless forced), so every reply has the search's results to answer from; the
answer's sentences that use a result cite it, in each API's own fields.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.live import LiveServer, live_server
from tests.server.spec_check import check_openai, check_responses_event, parse_sse

CHAT = "smollm2"
QUESTION = "What color is the Zorblax fruit?"
DOCS = {
    "zorblax.md": "# The Zorblax fruit\n\nThe Zorblax fruit is bright purple. It grows on the "
    "island of Quell and tastes of pepper.\n",
    "trains.txt": "Night trains\n\nThe night train leaves the northern station at ten.\n",
    "garden.html": "<html><head><title>Garden care</title></head><body><p>Water the fruit "
    "trees weekly in summer.</p></body></html>",
}


@pytest.fixture(scope="module")
def docs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("search-docs")
    for name, text in DOCS.items():
        (folder / name).write_text(text)
    return folder


@pytest.fixture(scope="module")
def search_server(
    smollm2_gguf: Path, minilm_dir: Path, docs: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("search-serve")
    config = {
        "chat": {"GGUF": {"model_id": "smollm2"}, "max_seqs": 4, "max_seq_len": 2048},
        "embed": {"Embedding": {"model_id": "minilm"}},
    }
    (tmp / "models.json").write_text(json.dumps(config))
    args = ["--config", str(tmp / "models.json"), "--dtype", "f32"]
    args += ["--search-dir", str(docs), "--search-embedding-model", "minilm"]
    with live_server(args, tmp / "serve.log") as live:
        yield live


@pytest.fixture(scope="module")
def search_client(search_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=search_server.api, api_key="none", max_retries=0, _strict_response_validation=True
    ) as c:
        yield c


def _uri(docs: Path, name: str) -> str:
    return (docs / name).resolve().as_uri()


def _check_spans(text: str, cited: list[tuple[int, int, str, str]], docs: Path) -> None:
    """Each citation is a real span of ``text`` sharing words with the real document it
    names, by its title."""
    titles = {_uri(docs, "zorblax.md"): "The Zorblax fruit", _uri(docs, "trains.txt"): "trains"}
    titles[_uri(docs, "garden.html")] = "Garden care"
    assert cited, text
    for start, end, url, title in cited:
        assert 0 <= start < end <= len(text)
        assert titles[url] == title
        name = url.rsplit("/", 1)[1]
        words = {w.lower().strip(".,") for w in text[start:end].split()}
        assert words & set(DOCS[name].lower().replace(".", " ").split()), (text, name)
    assert _uri(docs, "zorblax.md") in {c[2] for c in cited}


def test_chat_with_web_search_options_cites_the_documents_in_annotations(
    search_client: openai.OpenAI, search_server: LiveServer, docs: Path
) -> None:
    body = {
        "model": CHAT,
        "messages": [{"role": "user", "content": QUESTION}],
        "web_search_options": {"search_context_size": "low"},
        "temperature": 0,
        "max_tokens": 48,
    }
    raw = httpx.post(f"{search_server.api}/chat/completions", json=body, timeout=300)
    assert raw.status_code == 200, raw.text
    check_openai("CreateChatCompletionResponse", raw.json())
    reply = search_client.chat.completions.create(**body)  # type: ignore[call-overload]
    message = reply.choices[0].message
    assert message.content == raw.json()["choices"][0]["message"]["content"]
    assert message.annotations is not None
    spans = [a.url_citation for a in message.annotations]
    cited = [(c.start_index, c.end_index, c.url, c.title) for c in spans]
    assert all(a.type == "url_citation" for a in message.annotations)
    _check_spans(message.content or "", cited, docs)

    # streamed: the same text, and the same annotations in a delta before the end
    with httpx.stream(
        "POST",
        f"{search_server.api}/chat/completions",
        json=body | {"stream": True},
        timeout=300,
    ) as streamed:
        events = parse_sse(streamed.read().decode())
    chunks = [e.json() for e in events if e.data != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == message.content
    sent = [d["annotations"] for d in deltas if "annotations" in d]
    assert sent == [raw.json()["choices"][0]["message"]["annotations"]]


def test_responses_with_the_web_search_tool_has_a_call_item_and_annotated_text(
    search_client: openai.OpenAI, search_server: LiveServer, docs: Path
) -> None:
    response = search_client.responses.create(
        model=CHAT,
        input=QUESTION,
        tools=[{"type": "web_search", "search_context_size": "low"}],
        temperature=0,
        max_output_tokens=48,
    )
    raw = httpx.get(f"{search_server.api}/responses/{response.id}", timeout=30).json()
    check_openai("Response", raw)
    call, answer = response.output
    assert call.type == "web_search_call" and call.status == "completed"
    assert call.action.type == "search"
    assert call.action.query == QUESTION
    sources = [s.url for s in call.action.sources or ()]
    assert sources[0] == _uri(docs, "zorblax.md")  # reranked by MiniLM; bm25 agrees here
    assert set(sources) <= {_uri(docs, n) for n in DOCS}
    assert answer.type == "message"
    text = answer.content[0]
    assert text.type == "output_text"
    cited = [(a.start_index, a.end_index, a.url, a.title) for a in text.annotations]
    assert all(a.type == "url_citation" for a in text.annotations)
    _check_spans(text.text, cited, docs)
    assert response.tools[0].type == "web_search"

    # a next turn takes the stored output (its web_search_call item included) as history
    follow = search_client.responses.create(
        model=CHAT,
        input="Thanks.",
        previous_response_id=response.id,
        max_output_tokens=8,
    )
    assert follow.status in ("completed", "incomplete")


def test_a_streamed_response_sends_the_search_and_annotation_events(
    search_server: LiveServer,
) -> None:
    body = {
        "model": CHAT,
        "input": QUESTION,
        "tools": [{"type": "web_search_preview"}],
        "temperature": 0,
        "max_output_tokens": 48,
        "stream": True,
    }
    with httpx.stream("POST", f"{search_server.api}/responses", json=body, timeout=300) as r:
        events = [e.json() for e in parse_sse(r.read().decode())]
    for event in events:
        check_responses_event(event)
    kinds = [e["type"] for e in events]
    search = [k for k in kinds if k.startswith("response.web_search_call.")]
    assert search == [
        "response.web_search_call.in_progress",
        "response.web_search_call.searching",
        "response.web_search_call.completed",
    ]
    added = [
        e["annotation"] for e in events if e["type"] == "response.output_text.annotation.added"
    ]
    final = events[-1]["response"]
    assert final["output"][0]["type"] == "web_search_call"
    assert added and added == final["output"][1]["content"][0]["annotations"]


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "web_search_options": {}, "n": 2},
            "n",
            "web search answers with one choice",
        ),
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "web_search_options": []},
            "web_search_options",
            "must be an object",
        ),
        (
            "/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "web_search_options": {},
                "tool_choice": "none",
            },
            "tool_choice",
            "asks for web search",
        ),
        (
            "/responses",
            {"input": "hi", "tools": [{"type": "web_search"}], "background": True},
            "background",
            "foreground only",
        ),
        (
            "/responses",
            {"input": "hi", "tools": [{"type": "web_search", "search_context_size": "huge"}]},
            "tools.0.search_context_size",
            "low, medium or high",
        ),
    ],
)
def test_web_search_asks_the_server_cannot_serve_are_400s(
    search_server: LiveServer, path: str, body: dict[str, Any], param: str, message: str
) -> None:
    resp = httpx.post(f"{search_server.api}{path}", json={"model": CHAT} | body, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and message in error["message"]


def test_without_a_search_backend_web_search_is_a_400(client: openai.OpenAI, model: str) -> None:
    """The shared server has no --search-dir or --search-url."""
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": QUESTION}],
            web_search_options={},
        )
    with pytest.raises(openai.BadRequestError) as responses:
        client.responses.create(model=model, input=QUESTION, tools=[{"type": "web_search"}])
    chat_error, responses_error = chat.value.body, responses.value.body
    assert isinstance(chat_error, dict) and isinstance(responses_error, dict)
    assert chat_error["param"] == "web_search_options"
    assert responses_error["param"] == "tools.0.type"
    for error in (chat_error, responses_error):
        assert "web search is not available on this server" in error["message"]
        assert "--search-dir or --search-url" in error["message"]
