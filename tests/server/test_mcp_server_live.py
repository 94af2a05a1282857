"""inferd's models as MCP tools, through the official SDK's client: `inferd mcp` over stdio (the
real default model; the real MiniLM for embed) and `inferd serve --mcp-route` at /mcp
(streamable HTTP, behind the API key, Host and Origin checked)."""

from __future__ import annotations

import asyncio
import math
import os
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import httpx
import httpx2
import openai
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.types import CallToolResult

from tests.server.live import LiveServer, live_server

T = TypeVar("T")
KEY = "mcp-test-key"
HELLO = [{"role": "user", "content": "Name a color."}]
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "test", "version": "0"},
    },
}


class HeldClient:
    """One MCP client session held open on its own event-loop thread, so a module's tests
    share one `inferd mcp` process (its model loads once). The session lives in one task
    from start to end, as the SDK's cancel scopes want; calls come in from other tasks."""

    def __init__(self, server: StdioServerParameters) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.client: Client | None = None
        self.opened: Future[None] = Future()
        self.stop = asyncio.Event()
        self.held = asyncio.run_coroutine_threadsafe(self._hold(server), self.loop)
        self.opened.result(timeout=180)  # the model loads (kernels build) before it answers

    async def _hold(self, server: StdioServerParameters) -> None:
        try:
            async with Client(server) as client:
                self.client = client
                self.opened.set_result(None)
                await self.stop.wait()
        except BaseException as exc:
            if not self.opened.done():
                self.opened.set_exception(exc)
            raise

    def run(self, call: Callable[[Client], Awaitable[T]]) -> T:
        assert self.client is not None
        client = self.client

        async def go() -> T:
            return await call(client)

        return asyncio.run_coroutine_threadsafe(go(), self.loop).result(timeout=300)

    def call(self, name: str, arguments: dict[str, Any]) -> CallToolResult:
        return self.run(lambda c: c.call_tool(name, arguments))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.held.result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def _stdio(*args: str) -> StdioServerParameters:
    """`inferd mcp ARGS` from this checkout (the SDK passes only a few variables on)."""
    env = {k: v for k, v in os.environ.items() if k.startswith("INFERD_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    return StdioServerParameters(
        command=sys.executable, args=["-m", "inferd", "mcp", *args], env=env
    )


@pytest.fixture(scope="module")
def chat_mcp(smollm2_gguf: Path) -> Iterator[HeldClient]:
    """`inferd mcp` on the default model (no -m), float32 so greedy text is reproducible."""
    held = HeldClient(_stdio("--dtype", "f32", "--max-seq-len", "2048"))
    yield held
    held.close()


@pytest.fixture(scope="module")
def embed_mcp(minilm_dir: Path) -> Iterator[HeldClient]:
    held = HeldClient(_stdio("-m", "minilm"))
    yield held
    held.close()


def _error(result: CallToolResult) -> str:
    assert result.is_error, result
    (block,) = result.content
    assert block.type == "text"
    return block.text


def _ok(result: CallToolResult) -> dict[str, Any]:
    assert not result.is_error, result.content
    assert isinstance(result.structured_content, dict)
    return result.structured_content


# -- stdio --------------------------------------------------------------------------------------
def test_stdio_lists_the_tools_with_their_schemas(chat_mcp: HeldClient) -> None:
    tools = {t.name: t for t in chat_mcp.run(lambda c: c.list_tools()).tools}
    assert set(tools) == {"chat", "complete", "embed", "list_models"}
    chat = tools["chat"].input_schema
    assert chat["additionalProperties"] is False
    assert chat["properties"]["max_tokens"] == {
        "type": "integer",
        "minimum": 1,
        "description": chat["properties"]["max_tokens"]["description"],
    }
    assert tools["embed"].input_schema["required"] == ["texts"]
    assert tools["complete"].input_schema["required"] == ["prompt"]


def test_stdio_list_models_names_the_default_model(chat_mcp: HeldClient) -> None:
    (card,) = _ok(chat_mcp.call("list_models", {}))["models"]
    assert (card["id"], card["kind"], card["status"]) == ("smollm2", "chat", "loaded")
    assert card["max_model_len"] == 2048


def test_stdio_greedy_chat_is_the_same_text_twice(chat_mcp: HeldClient) -> None:
    args = {"messages": HELLO, "max_tokens": 8, "temperature": 0}
    first, second = (_ok(chat_mcp.call("chat", args)) for _ in range(2))
    assert first["text"] and first["text"] == second["text"]
    assert first["model"] == "smollm2"
    assert first["usage"]["completion_tokens"] <= 8
    assert first["finish_reason"] in ("stop", "length")
    # prompt is the one-user-message form of the same conversation
    one = {"prompt": "Name a color.", "max_tokens": 8, "temperature": 0}
    by_prompt = _ok(chat_mcp.call("chat", one))
    assert by_prompt["text"] == first["text"]
    result = chat_mcp.call("chat", args)
    (block,) = result.content
    assert block.type == "text" and block.text == first["text"]


def test_stdio_complete_continues_the_text(chat_mcp: HeldClient) -> None:
    args = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    one, two = (_ok(chat_mcp.call("complete", args)) for _ in range(2))
    assert one["text"] and one["text"] == two["text"]
    assert one["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize(
    ("name", "arguments", "says"),
    [
        ("chat", {"messages": HELLO, "temperature": "hot"}, "temperature"),
        ("chat", {"messages": HELLO, "max_tokens": 0}, "max_tokens"),
        ("chat", {"messages": HELLO, "colour": "red"}, "colour"),
        ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ("chat", {}, "give messages"),
        ("chat", {"messages": HELLO, "prompt": "hi"}, "not both"),
        ("complete", {"max_tokens": 4}, "prompt"),
        ("embed", {"texts": []}, "texts"),
        # checks of the API itself, in its own words
        ("chat", {"messages": HELLO, "model": "no-such-model"}, "no-such-model"),
        ("chat", {"messages": HELLO, "max_tokens": 4, "stop": ["a"] * 40}, "stop"),
        ("chat", {"messages": HELLO, "max_tokens": 100000}, "max_tokens"),
        # no embedding model is served here
        ("embed", {"texts": ["hi"]}, "embedding"),
    ],
)
def test_stdio_bad_arguments_are_tool_errors(
    chat_mcp: HeldClient, name: str, arguments: dict[str, Any], says: str
) -> None:
    assert says in _error(chat_mcp.call(name, arguments))


def test_stdio_server_still_answers_after_errors(chat_mcp: HeldClient) -> None:
    _error(chat_mcp.call("chat", {"messages": "not a list"}))
    assert _ok(chat_mcp.call("chat", {"prompt": "Hi", "max_tokens": 2, "temperature": 0}))["text"]


def test_stdio_embed_on_minilm(embed_mcp: HeldClient) -> None:
    texts = ["The cat sat on the mat.", "A cat was sitting on a mat.", "Stock prices fell."]
    got = _ok(embed_mcp.call("embed", {"texts": texts}))
    assert (got["model"], got["dimensions"], len(got["embeddings"])) == ("minilm", 384, 3)
    cat, kitten, stocks = got["embeddings"]
    for vector in (cat, kitten, stocks):
        assert math.isclose(math.fsum(x * x for x in vector), 1.0, abs_tol=1e-4)

    def cosine(a: list[float], b: list[float]) -> float:
        return math.fsum(x * y for x, y in zip(a, b, strict=True))

    assert cosine(cat, kitten) > cosine(cat, stocks)
    again = _ok(embed_mcp.call("embed", {"texts": texts[:1], "model": "minilm"}))
    assert max(abs(x - y) for x, y in zip(again["embeddings"][0], cat, strict=True)) < 1e-5
    # a chat tool on an embedding model: the API's message
    assert "embedding" in _error(embed_mcp.call("chat", {"prompt": "hi", "max_tokens": 2}))


# -- /mcp on inferd serve -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def mcp_server(
    smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("serve-mcp") / "serve.log"
    args = ["-m", str(smollm2_gguf), "--dtype", "f32", "--max-seq-len", "2048"]
    with live_server([*args, "--mcp-route", "--api-key", KEY], log) as live:
        yield live


def _over_http(url: str, key: str, work: Callable[[Client], Coroutine[Any, Any, T]]) -> T:
    async def go() -> T:
        headers = {"Authorization": f"Bearer {key}"}
        async with (
            httpx2.AsyncClient(headers=headers, timeout=120) as http,
            Client(streamable_http_client(url, http_client=http)) as client,
        ):
            return await work(client)

    return asyncio.run(go())


def test_http_route_with_the_key_answers_as_the_api_does(mcp_server: LiveServer) -> None:
    url = mcp_server.url + "/mcp"
    tools = _over_http(url, KEY, lambda c: c.list_tools())
    assert {t.name for t in tools.tools} == {"chat", "complete", "embed", "list_models"}
    args = {"messages": HELLO, "max_tokens": 8, "temperature": 0}
    result = _over_http(url, KEY, lambda c: c.call_tool("chat", args))
    got = _ok(result)
    with openai.OpenAI(base_url=mcp_server.api, api_key=KEY, max_retries=0) as sdk:
        reply = sdk.chat.completions.create(
            model=got["model"],
            messages=HELLO,
            max_tokens=8,
            temperature=0,  # type: ignore[arg-type]
        )
    assert got["text"] == reply.choices[0].message.content
    bad = _over_http(url, KEY, lambda c: c.call_tool("chat", {"messages": HELLO, "top_p": 5}))
    assert "top_p" in _error(bad)


def test_http_route_without_the_right_key_is_401(mcp_server: LiveServer) -> None:
    url = mcp_server.url + "/mcp"
    accept = {"Accept": "application/json, text/event-stream"}
    for extra in ({}, {"Authorization": "Bearer wrong"}):
        resp = httpx.post(url, json=INITIALIZE, headers=accept | extra, timeout=30)
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "invalid_api_key"


def test_http_route_checks_host_and_origin(mcp_server: LiveServer) -> None:
    url = mcp_server.url + "/mcp"
    port = url.split(":")[2].split("/")[0]
    base = {"Accept": "application/json, text/event-stream", "Authorization": f"Bearer {KEY}"}
    rebound = httpx.post(url, json=INITIALIZE, headers=base | {"Host": f"evil.example:{port}"})
    assert rebound.status_code == 421
    foreign = httpx.post(url, json=INITIALIZE, headers=base | {"Origin": "http://evil.example"})
    assert foreign.status_code == 403
    assert foreign.json()["error"]["code"] == "origin_not_allowed"
    own = httpx.post(url, json=INITIALIZE, headers=base | {"Origin": f"http://127.0.0.1:{port}"})
    assert own.status_code == 200, own.text
    assert own.json()["result"]["serverInfo"]["name"] == "inferd"


def test_no_mcp_route_without_the_flag(server: LiveServer) -> None:
    accept = {"Accept": "application/json, text/event-stream"}
    resp = httpx.post(server.url + "/mcp", json=INITIALIZE, headers=accept, timeout=30)
    assert resp.status_code == 404
    assert "no route" in resp.json()["error"]["message"]
