"""Several models in one real `inferd serve --config`: a chat model, an embedding model and two
entries that cannot load (a Plain directory without weights, a corrupt GGUF); model selection,
listing, readiness, and the unload / reload lifecycle with draining."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.live import LiveServer, live_server

CHAT, EMBED, PLAIN, CORRUPT = "smollm2", "minilm", "plain-llm", "corrupt"
HI = [{"role": "user", "content": "Tell me a long story about a dragon."}]


@pytest.fixture(scope="module")
def multi(
    smollm2_gguf: Path, minilm_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("multi")
    (tmp / "llm").mkdir()
    (tmp / "corrupt.gguf").write_bytes(b"GGUF" + b"\x00" * 64)
    config = {
        "chat": {"GGUF": {"model_id": "smollm2"}, "max_seqs": 4, "max_seq_len": 2048},
        "embed": {"Embedding": {"model_id": "minilm"}},
        "planned": {"Plain": {"model_id": str(tmp / "llm")}, "alias": PLAIN},
        "broken": {"GGUF": {"model_id": str(tmp / "corrupt.gguf")}},
    }
    (tmp / "models.json").write_text(json.dumps(config))
    args = ["--config", str(tmp / "models.json"), "--kv-cache-tokens", "8192", "--dtype", "f32"]
    with live_server(args, tmp / "serve.log") as live:
        _wait_settled(live)
        yield live


def _statuses(http: httpx.Client) -> dict[str, str]:
    return {m["id"]: m["status"] for m in http.get("/v1/models").json()["data"]}


def _wait_settled(live: LiveServer, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=live.url, timeout=10) as http:
        while time.monotonic() < deadline:
            if not {"loading", "reloading"} & set(_statuses(http).values()):
                return
            time.sleep(0.2)
    raise TimeoutError("the models did not finish loading")


@pytest.fixture(scope="module")
def http(multi: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=multi.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def client(multi: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=multi.api, api_key="none", max_retries=0, _strict_response_validation=True
    ) as c:
        yield c


def _cards(http: httpx.Client) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in http.get("/v1/models").json()["data"]}


def test_models_lists_default_first_then_every_model_with_its_status(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    assert [m.id for m in client.models.list().data] == ["default", CHAT, EMBED, PLAIN, CORRUPT]
    cards = _cards(http)
    assert cards["default"]["alias_for"] == CHAT  # the first to load
    assert {k: c["status"] for k, c in cards.items()} == {
        "default": "loaded",
        CHAT: "loaded",
        EMBED: "loaded",
        PLAIN: "error",
        CORRUPT: "error",
    }
    assert cards[CHAT]["modalities"] == {"input": ["text"], "output": ["text"]}
    assert cards[EMBED]["modalities"] == {"input": ["text"], "output": ["embedding"]}
    assert (cards[CHAT]["label"], cards[EMBED]["label"], cards[PLAIN]["label"]) == (
        "chat",
        "embed",
        "planned",
    )
    assert "llm: no .safetensors files in this directory" in cards[PLAIN]["error"]
    assert cards[CORRUPT]["error"]
    assert cards[CHAT]["max_model_len"] == 2048


def test_ready_only_when_every_model_is_loaded(http: httpx.Client) -> None:
    resp = http.get("/ready")
    assert resp.status_code == 503
    assert resp.json()["models"] == {
        CHAT: "loaded",
        EMBED: "loaded",
        PLAIN: "error",
        CORRUPT: "error",
    }
    assert http.get("/health").status_code == 200


def test_default_and_omitted_model_go_to_the_default(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    reply = client.chat.completions.create(model="default", messages=HI, max_tokens=3)  # type: ignore[arg-type]
    assert reply.model == CHAT
    resp = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 3})
    assert resp.status_code == 200 and resp.json()["model"] == CHAT


def test_each_kind_answers_its_own_routes(client: openai.OpenAI, http: httpx.Client) -> None:
    emb = client.embeddings.create(model=EMBED, input=["a", "b"], encoding_format="float")
    assert emb.model == EMBED and len(emb.data[1].embedding) == 384
    chat = client.chat.completions.create(model=CHAT, messages=HI, max_tokens=3)  # type: ignore[arg-type]
    assert chat.choices[0].finish_reason == "length"
    wrong = http.post("/v1/embeddings", json={"model": CHAT, "input": "x"})
    assert wrong.status_code == 400
    assert wrong.json()["error"]["message"] == (
        "the model 'smollm2' is a chat model: it serves chat and completions "
        "(/v1/chat/completions, /v1/completions, /v1/messages) only; /v1/embeddings needs an "
        "embedding model (embedding models here: minilm)"
    )
    for path, body in [
        ("/v1/chat/completions", {"model": EMBED, "messages": HI}),
        ("/v1/completions", {"model": EMBED, "prompt": "x"}),
    ]:
        resp = http.post(path, json=body)
        assert resp.status_code == 400, path
        assert "'minilm' is an embedding model" in resp.json()["error"]["message"]


def test_a_model_that_failed_to_load_answers_503_with_the_reason(http: httpx.Client) -> None:
    resp = http.post("/v1/chat/completions", json={"model": PLAIN, "messages": HI})
    assert resp.status_code == 503
    assert "failed to load: " in resp.json()["error"]["message"]
    assert "no .safetensors files" in resp.json()["error"]["message"]
    resp = http.post("/v1/completions", json={"model": CORRUPT, "prompt": "x"})
    assert resp.status_code == 503 and "failed to load" in resp.json()["error"]["message"]


def _op(http: httpx.Client, op: str, model_id: str, **extra: Any) -> httpx.Response:
    return http.post(f"/v1/models/{op}", json={"model_id": model_id, **extra})


def test_lifecycle_answers_with_proper_status_codes(http: httpx.Client) -> None:
    for op in ("unload", "reload", "status"):
        resp = _op(http, op, "nope")
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
        missing = http.post(f"/v1/models/{op}", json={})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "model_id"
    assert _op(http, "status", EMBED).json() == _op(http, "status", EMBED).json()
    assert _op(http, "status", EMBED).json()["status"] == "loaded"
    conflict = _op(http, "reload", EMBED)
    assert conflict.status_code == 409 and "already loaded" in conflict.json()["error"]["message"]

    done = _op(http, "unload", EMBED)
    assert done.status_code == 200
    assert done.json() | {"load_seconds": 0} == {
        "model_id": EMBED,
        "status": "unloaded",
        "kind": "embedding",
        "drained": 0,
        "aborted": 0,
        "load_seconds": 0,
    }
    again = _op(http, "unload", EMBED)
    assert again.status_code == 409 and "unloaded, not loaded" in again.json()["error"]["message"]
    assert _op(http, "status", EMBED).json()["status"] == "unloaded"
    assert _cards(http)[EMBED]["status"] == "unloaded"

    # auto-reload (on by default): the next request loads it again and is answered
    resp = http.post("/v1/embeddings", json={"model": EMBED, "input": "back again"})
    assert resp.status_code == 200 and len(resp.json()["data"][0]["embedding"]) == 384
    assert _op(http, "status", EMBED).json()["status"] == "loaded"

    failed = _op(http, "reload", PLAIN)
    assert failed.status_code == 503
    assert failed.json()["error"]["code"] == "model_load_failed"
    assert "no .safetensors files" in failed.json()["error"]["message"]
    assert _op(http, "status", PLAIN).json()["status"] == "error"


def _stream_chat(url: str, max_tokens: int, events: list[Any], started: threading.Event) -> None:
    body = {"model": CHAT, "messages": HI, "max_tokens": max_tokens, "ignore_eos": True}
    body["stream"] = True
    with (
        httpx.Client(base_url=url, timeout=300) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as resp,
    ):
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
            if len(events) == 2:  # the role chunk, then the first content
                started.set()
    events.append("closed")
    started.set()


def test_unload_lets_running_requests_finish(multi: LiveServer, http: httpx.Client) -> None:
    events: list[Any] = []
    started = threading.Event()
    reader = threading.Thread(target=_stream_chat, args=(multi.url, 120, events, started))
    reader.start()
    assert started.wait(120)
    resp = _op(http, "unload", CHAT, drain_timeout=300)
    reader.join(120)
    assert resp.status_code == 200
    assert (resp.json()["drained"], resp.json()["aborted"]) == (1, 0)  # it waited for the stream
    assert events.pop() == "closed"
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert not any("error" in e for e in events[:-1])
    assert _op(http, "status", CHAT).json()["status"] == "unloaded"
    assert http.get("/metrics").status_code == 200  # engine gauges skip unloaded models


def test_requests_for_an_unloaded_model_reload_it(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    if _op(http, "status", CHAT).json()["status"] == "loaded":
        assert _op(http, "unload", CHAT).status_code == 200
    reply = client.chat.completions.create(model=CHAT, messages=HI, max_tokens=2)  # type: ignore[arg-type]
    assert reply.model == CHAT
    assert _op(http, "status", CHAT).json()["status"] == "loaded"


def test_unload_deadline_aborts_streams_with_an_error_event(
    multi: LiveServer, http: httpx.Client
) -> None:
    assert _op(http, "status", CHAT).json()["status"] == "loaded"
    events: list[Any] = []
    started = threading.Event()
    reader = threading.Thread(target=_stream_chat, args=(multi.url, 1900, events, started))
    reader.start()
    assert started.wait(120)
    resp = _op(http, "unload", CHAT, drain_timeout=0)
    reader.join(120)
    assert resp.status_code == 200
    assert (resp.json()["drained"], resp.json()["aborted"]) == (0, 1)
    assert events.pop() == "closed"
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["type"] == "server_error" and error["message"]
    assert not any(c["choices"][0]["finish_reason"] for c in events[:-2] if "choices" in c)
    # the embedding model kept serving throughout
    assert http.post("/v1/embeddings", json={"model": EMBED, "input": "x"}).status_code == 200
    assert _op(http, "reload", CHAT).json()["status"] == "loaded"
