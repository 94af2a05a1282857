"""inferd inside other applications: the Python Engine API, and build_app mounted under a
sub-path of a FastAPI app (examples/mount_app.py) served by a real uvicorn on loopback."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from examples.mount_app import create_app
from inferd import Engine, EngineError
from inferd.bench.process import free_port
from inferd.config import EngineConfig
from inferd.server import ServerOptions, build_app
from inferd.serving.loading import Servable, load_spec
from inferd.serving.registry import LoadEvent, ModelSlot, ModelStatus
from inferd.serving.spec import ModelSpec

KEY = "sk-notes-test-key"
HI = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def progress() -> list[LoadEvent]:
    return []


@pytest.fixture(scope="module")
def chat(smollm2_gguf: Path, progress: list[LoadEvent]) -> Iterator[Engine]:
    cfg = EngineConfig(dtype="f32", max_num_seqs=4, kv_cache_tokens=4096)
    engine = Engine.from_spec("smollm2", engine_config=cfg, on_progress=progress.append)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def embed(minilm_dir: Path) -> Iterator[Engine]:
    engine = Engine.from_spec("minilm")
    yield engine
    engine.shutdown()


# -- the Python API -----------------------------------------------------------------------------
def test_loading_reports_progress_and_can_be_awaited(
    chat: Engine, embed: Engine, progress: list[LoadEvent]
) -> None:
    async def main() -> None:
        assert await chat is chat  # awaiting an engine waits for its load
        assert (await embed.load()) is embed

    asyncio.run(main())
    assert chat.status is ModelStatus.LOADED and chat.kind == "chat"
    assert embed.status is ModelStatus.LOADED and embed.kind == "embedding"
    assert [(e.model_id, e.status) for e in progress] == [
        ("smollm2", ModelStatus.LOADING),
        ("smollm2", ModelStatus.LOADED),
    ]
    assert progress[-1].elapsed > 0 and progress[-1].error is None


def test_chat_and_generate_agree(chat: Engine) -> None:
    async def main() -> tuple[str, str, list[str | None], int, int]:
        reply = await chat.chat(HI, max_tokens=8, temperature=0.0)
        parts: list[str] = []
        reasons: list[str | None] = []
        async for delta in chat.generate(HI, max_tokens=8, temperature=0.0):
            parts.append(delta.text)
            reasons.append(delta.finish_reason)
        return (
            reply.text,
            "".join(parts),
            reasons,
            reply.usage.completion_tokens,
            reply.usage.total_tokens,
        )

    text, streamed, reasons, completion, total = asyncio.run(main())
    assert text and text == streamed
    assert reasons[-1] in ("stop", "length") and all(r is None for r in reasons[:-1])
    assert 1 <= completion <= 8 and total > completion


def test_generate_continues_a_prompt(chat: Engine) -> None:
    async def main() -> list[str]:
        return [
            d.text async for d in chat.generate(prompt="The capital of France is", max_tokens=4)
        ]

    assert len("".join(asyncio.run(main()))) > 0


def test_embed_vectors(embed: Engine) -> None:
    async def main() -> tuple[list[list[float]], list[float], int]:
        result = await embed.embed(
            ["A man is eating food.", "A man eats a meal.", "Stock prices fell."]
        )
        ids = [101, 7592, 2088, 102]  # [CLS] hello world [SEP]
        by_ids = await embed.embed(ids)
        by_text = await embed.embed("hello world")
        assert by_ids.vectors[0] == pytest.approx(by_text.vectors[0], abs=1e-6)
        return result.vectors, by_text.vectors[0], result.usage.prompt_tokens

    vectors, hello, tokens = asyncio.run(main())
    assert len(vectors) == 3 and all(len(v) == 384 for v in vectors)
    assert math.fsum(x * x for x in hello) == pytest.approx(1.0, abs=1e-4)

    def cos(a: list[float], b: list[float]) -> float:
        return math.fsum(x * y for x, y in zip(a, b, strict=True))

    assert cos(vectors[0], vectors[1]) > cos(vectors[0], vectors[2])
    assert tokens > 3


def test_each_engine_does_its_own_kind(chat: Engine, embed: Engine) -> None:
    async def main() -> None:
        with pytest.raises(EngineError, match="'smollm2' is a chat model"):
            await chat.embed("x")
        with pytest.raises(EngineError, match="'minilm' is an embedding model"):
            await embed.chat(HI)

    asyncio.run(main())


def test_a_failed_load_says_why(tmp_path: Path) -> None:
    events: list[LoadEvent] = []
    engine = Engine.from_spec(tmp_path / "missing.gguf", on_progress=events.append)

    async def main() -> None:
        with pytest.raises(EngineError, match=r"missing\.gguf"):
            await engine.load()

    asyncio.run(main())
    assert engine.status is ModelStatus.ERROR and "missing.gguf" in (engine.error or "")
    assert events[-1].status is ModelStatus.ERROR
    with pytest.raises(EngineError):
        engine.wait()


def test_build_app_without_auto_reload(embed: Engine) -> None:
    """An unloaded model gets 503 until reloaded; driven in-process through ASGITransport."""
    app = build_app([embed], ServerOptions(auto_reload=False, access_log_format=None))

    async def main() -> None:
        await embed.load()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://inferd") as http:
            body = {"model": "minilm", "input": "x"}
            assert (await http.post("/v1/embeddings", json=body)).status_code == 200
            unload = await http.post("/v1/models/unload", json={"model_id": "minilm"})
            assert unload.json()["status"] == "unloaded"
            refused = await http.post("/v1/embeddings", json=body)
            assert refused.status_code == 503
            assert "is unloaded; POST /v1/models/reload" in refused.json()["error"]["message"]
            assert (await http.get("/ready")).status_code == 503
            reload = await http.post("/v1/models/reload", json={"model_id": "minilm"})
            assert reload.status_code == 200 and reload.json()["status"] == "loaded"
            assert (await http.post("/v1/embeddings", json=body)).status_code == 200
            assert (await http.get("/ready")).status_code == 200

    asyncio.run(main())


def test_lifecycle_conflicts_while_a_load_runs(minilm_dir: Path) -> None:
    """Loads held at a gate, so each transition is observed at a known point."""
    gate = threading.Event()
    spec = ModelSpec(model_id=str(minilm_dir), kind="Embedding", alias="gated")

    def gated_load() -> Servable:
        assert gate.wait(120)
        return load_spec(spec, EngineConfig())

    slot = ModelSlot("gated", "embedding", gated_load)
    app = build_app([slot], ServerOptions(access_log_format=None))

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://inferd") as http:

            async def op(name: str) -> httpx.Response:
                return await http.post(f"/v1/models/{name}", json={"model_id": "gated"})

            async def until(status: str) -> None:
                for _ in range(6000):
                    if (await op("status")).json()["status"] == status:
                        return
                    await asyncio.sleep(0.01)
                raise AssertionError(f"never {status}")

            assert (await op("status")).json()["status"] == "unloaded"
            body = {"model": "gated", "input": "wait for me"}
            request = asyncio.ensure_future(http.post("/v1/embeddings", json=body))
            await until("loading")  # the request started the load (auto-reload)
            for name, message in [("reload", "already loading"), ("unload", "is loading")]:
                resp = await op(name)
                assert resp.status_code == 409 and message in resp.json()["error"]["message"]
            assert (await http.get("/ready")).status_code == 503
            gate.set()
            answered = await request
            assert answered.status_code == 200 and answered.json()["model"] == "gated"
            assert (await http.get("/ready")).status_code == 200

            gate.clear()
            assert (await op("unload")).json()["status"] == "unloaded"
            reload = asyncio.ensure_future(op("reload"))
            await until("reloading")
            for name, message in [("reload", "already reloading"), ("unload", "is reloading")]:
                resp = await op(name)
                assert resp.status_code == 409 and message in resp.json()["error"]["message"]
            gate.set()
            assert (await reload).json()["status"] == "loaded"

    try:
        asyncio.run(main())
    finally:
        gate.set()
        slot.shutdown()


# -- mounted inside an application --------------------------------------------------------------
@pytest.fixture(scope="module")
def notes(chat: Engine, embed: Engine) -> Iterator[tuple[str, object]]:
    """The example app, with inferd mounted at /ai, on a real uvicorn on loopback."""
    app = create_app(chat, embed, ServerOptions(api_keys=(KEY,), access_log_format=None))
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", ws="none")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield f"http://127.0.0.1:{port}", app
    server.should_exit = True
    thread.join(30)


@pytest.fixture(scope="module")
def ai(notes: tuple[str, object]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=notes[0] + "/ai/v1", api_key=KEY, max_retries=0, _strict_response_validation=True
    ) as client:
        yield client


def test_the_apps_own_routes_use_the_engines(notes: tuple[str, object]) -> None:
    with httpx.Client(base_url=notes[0], timeout=120) as http:
        home = http.get("/").json()
        assert home["ai"] == "/ai/v1"
        assert home["models"] == {"smollm2": "loaded", "minilm": "loaded"}
        similar = http.post("/notes/similar", json={"a": "cats", "b": "kittens"}).json()
        assert 0.3 < similar["cosine"] <= 1.0
        title = http.post("/notes/title", json={"text": "Our picnic was rained out."})
        assert title.status_code == 200 and title.json()["title"]


def test_mounted_api_works_with_the_sdk(ai: openai.OpenAI) -> None:
    assert [m.id for m in ai.models.list().data] == ["default", "smollm2", "minilm"]
    reply = ai.chat.completions.create(model="smollm2", messages=HI, max_tokens=4)  # type: ignore[arg-type]
    assert reply.model == "smollm2" and reply.choices[0].message.content
    emb = ai.embeddings.create(model="minilm", input=["a", "b"], encoding_format="float")
    assert len(emb.data) == 2 and len(emb.data[0].embedding) == 384


def test_stream_hooks_see_every_chunk_and_the_end(
    notes: tuple[str, object], ai: openai.OpenAI
) -> None:
    app = notes[1]
    stream = ai.chat.completions.create(
        model="default",
        messages=HI,  # type: ignore[arg-type]
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    with stream:
        request_id = stream.response.headers["x-request-id"]
        chunks = list(stream)
    assert chunks[-1].usage is not None
    deadline = time.monotonic() + 10
    while not app.state.finished and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.01)
    assert app.state.streamed[request_id] == len(chunks)  # type: ignore[attr-defined]
    assert (request_id, "complete") in app.state.finished  # type: ignore[attr-defined]


def test_mounted_api_keeps_its_auth_and_envelopes(notes: tuple[str, object]) -> None:
    with httpx.Client(base_url=notes[0], timeout=30) as http:
        refused = http.get("/ai/v1/models")
        assert refused.status_code == 401 and "error" in refused.json()
        auth = {"Authorization": f"Bearer {KEY}"}
        missing = http.get("/ai/v1/nowhere", headers=auth)
        assert missing.status_code == 404 and missing.json()["error"]["message"]
        assert http.get("/ai/openapi.json", headers=auth).status_code == 200
        assert http.get("/ai/ready", headers=auth).status_code == 200
        assert http.get("/").status_code == 200  # the app's own routes are not behind inferd's keys
