"""/v1/embeddings on a real `inferd serve -m minilm`, through the openai SDK in strict mode."""

from __future__ import annotations

import base64
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from tokenizers import Tokenizer

from tests.server.live import LiveServer, live_server

MODEL = "minilm"


@pytest.fixture(scope="module")
def embed_server(
    minilm_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("serve-minilm") / "serve.log"
    with live_server(["-m", MODEL], log) as live:
        yield live


@pytest.fixture(scope="module")
def client(embed_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=embed_server.api, api_key="none", max_retries=0, _strict_response_validation=True
    ) as c:
        yield c


@pytest.fixture(scope="module")
def http(embed_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=embed_server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(minilm_dir: Path) -> Tokenizer:
    tok = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok


def _close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return max(abs(x - y) for x, y in zip(a, b, strict=True)) < tol


def test_models_lists_the_embedding_model(client: openai.OpenAI, http: httpx.Client) -> None:
    (model,) = client.models.list().data
    assert model.id == MODEL
    card = http.get("/v1/models").json()["data"][0]
    assert card["kind"] == "embedding" and card["status"] == "loaded"
    assert card["modalities"] == {"input": ["text"], "output": ["embedding"]}
    assert (card["dimensions"], card["max_model_len"]) == (384, 512)
    assert http.get("/ready").status_code == 200


def test_sdk_strict_float_request(client: openai.OpenAI) -> None:
    resp = client.embeddings.create(
        model=MODEL, input="The cat sat on the mat.", encoding_format="float"
    )
    (item,) = resp.data
    assert (resp.model, item.index, item.object) == (MODEL, 0, "embedding")
    assert len(item.embedding) == 384
    assert math.isclose(math.fsum(x * x for x in item.embedding), 1.0, abs_tol=1e-4)
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == 9


def test_sdk_default_request_decodes_our_base64(
    embed_server: LiveServer, client: openai.OpenAI
) -> None:
    """Without encoding_format the SDK asks for base64 and decodes it after validation. Its
    strict mode validates ``embedding: List[float]`` before decoding, so it refuses base64
    from any server (api.openai.com too); this check runs the SDK's decoding unstrict."""
    text = ["The cat sat on the mat.", "another"]
    with openai.OpenAI(base_url=embed_server.api, api_key="none", max_retries=0) as lenient:
        decoded = lenient.embeddings.create(model=MODEL, input=text)
    floats = client.embeddings.create(model=MODEL, input=text, encoding_format="float")
    for a, b in zip(decoded.data, floats.data, strict=True):
        assert a.embedding == np.asarray(b.embedding, dtype=np.float32).tolist()


def test_float_and_base64_carry_the_same_float32_values(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    text = ["similarity search", "vector databases"]
    floats = client.embeddings.create(model=MODEL, input=text, encoding_format="float")
    raw = http.post(
        "/v1/embeddings", json={"model": MODEL, "input": text, "encoding_format": "base64"}
    ).json()
    for f, b in zip(floats.data, raw["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        assert decoded.tolist() == np.asarray(f.embedding, dtype=np.float32).tolist()


def test_every_input_shape_gives_the_same_vectors(
    client: openai.OpenAI, tokenizer: Tokenizer
) -> None:
    texts = ["first sentence", "a second, somewhat longer sentence than the first"]
    ids = [tokenizer.encode(t).ids for t in texts]
    by_text = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    one_text = client.embeddings.create(model=MODEL, input=texts[1], encoding_format="float")
    one_ids = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="float")
    assert [d.index for d in by_text.data] == [0, 1]
    for a, b in zip(by_text.data, by_ids.data, strict=True):
        assert _close(a.embedding, b.embedding)
    assert _close(one_text.data[0].embedding, by_text.data[1].embedding)
    assert _close(one_ids.data[0].embedding, by_text.data[1].embedding)
    assert by_text.usage.prompt_tokens == by_ids.usage.prompt_tokens == sum(map(len, ids))


def test_similar_texts_are_closer(client: openai.OpenAI) -> None:
    texts = ["A man is eating food.", "A man is eating a meal.", "The stock market fell today."]
    resp = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    vecs = [np.asarray(d.embedding) for d in resp.data]
    assert float(vecs[0] @ vecs[1]) > float(vecs[0] @ vecs[2]) + 0.3


def test_dimensions_equal_to_the_models_own_are_accepted(client: openai.OpenAI) -> None:
    resp = client.embeddings.create(model=MODEL, input="x", dimensions=384, encoding_format="float")
    assert len(resp.data[0].embedding) == 384


def test_sdk_raises_bad_request_for_dimensions(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL, input="x", dimensions=64)
    assert "dimensions" in str(info.value)


LONG = "word " * 600

BAD: list[tuple[str, str, dict[str, Any], int, str, str | None]] = [
    ("empty string", "/v1/embeddings", {"input": ""}, 400, "must not be an empty string", "input"),
    ("empty list", "/v1/embeddings", {"input": []}, 400, "must not be an empty list", "input"),
    ("empty item", "/v1/embeddings", {"input": ["a", ""]}, 400, "input[1]: must not be", "input"),
    (
        "empty ids",
        "/v1/embeddings",
        {"input": [[101, 102], []]},
        400,
        "input[1]: must not",
        "input",
    ),
    ("missing input", "/v1/embeddings", {"model": MODEL}, 400, "input: is required", "input"),
    (
        "mixed",
        "/v1/embeddings",
        {"input": ["a", 1]},
        400,
        "mixes kinds or holds other values",
        "input",
    ),
    (
        "object",
        "/v1/embeddings",
        {"input": {"text": "a"}},
        400,
        "expected a string, a list",
        "input",
    ),
    ("bool ids", "/v1/embeddings", {"input": [True, False]}, 400, "expected a string", "input"),
    ("float ids", "/v1/embeddings", {"input": [[1.5]]}, 400, "list of token ids", "input"),
    (
        "id out of vocab",
        "/v1/embeddings",
        {"input": [101, 99999, 102]},
        400,
        "token id 99999, outside this model's vocabulary [0, 30522)",
        "input",
    ),
    (
        "too long",
        "/v1/embeddings",
        {"input": LONG},
        400,
        "input has 602 tokens, but minilm takes at most 512 tokens per input",
        "input",
    ),
    (
        "too long in a list",
        "/v1/embeddings",
        {"input": ["short", LONG]},
        400,
        "input[1] has 602 tokens, but minilm takes at most 512",
        "input",
    ),
    (
        "too many",
        "/v1/embeddings",
        {"input": ["a"] * 2049},
        400,
        "2049 items; at most 2048",
        "input",
    ),
    (
        "dimensions",
        "/v1/embeddings",
        {"input": "a", "dimensions": 128},
        400,
        "dimensions: minilm returns 384-dimensional vectors and cannot resize them to 128",
        "dimensions",
    ),
    (
        "bad format",
        "/v1/embeddings",
        {"input": "a", "encoding_format": "hex"},
        400,
        "",
        "encoding_format",
    ),
    (
        "unknown model",
        "/v1/embeddings",
        {"model": "nope", "input": "a"},
        404,
        "'nope' does not exist",
        "model",
    ),
    (
        "chat on an embedding model",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        400,
        "the model 'minilm' is an embedding model: it serves /v1/embeddings only; this route "
        "needs a chat model (chat models here: none on this server)",
        "model",
    ),
    (
        "completion on an embedding model",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi"},
        400,
        "is an embedding model",
        "model",
    ),
    ("not json", "/v1/embeddings", {}, 400, "", None),
]


@pytest.mark.parametrize(
    ("name", "path", "body", "status", "message", "param"), BAD, ids=[b[0] for b in BAD]
)
def test_bad_requests_get_clear_errors(
    http: httpx.Client,
    name: str,
    path: str,
    body: dict[str, Any],
    status: int,
    message: str,
    param: str | None,
) -> None:
    if name == "not json":
        resp = http.post(path, content=b"{nope", headers={"content-type": "application/json"})
    else:
        resp = http.post(path, json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert message in error["message"]
    assert error["param"] == param


def test_messages_on_an_embedding_model_answer_in_anthropics_envelope(http: httpx.Client) -> None:
    resp = http.post(
        "/v1/messages",
        headers={"anthropic-version": "2023-06-01"},
        json={"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert resp.status_code == 400
    body = resp.json()
    assert body["type"] == "error" and "is an embedding model" in body["error"]["message"]


def test_server_is_healthy_after_the_bad_requests(client: openai.OpenAI) -> None:
    resp = client.embeddings.create(model="default", input="still fine", encoding_format="float")
    assert resp.model == MODEL and len(resp.data) == 1
