"""--tool-dispatch-url against a real HTTP server on loopback: each call POSTed as
{"name", "arguments"}, the answer a string or {"content": ...}; everything else an error."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from inferd.agent.config import AgentConfig, AgentConfigError
from inferd.agent.dispatch import DispatchTools
from inferd.agent.toolbox import ToolBox
from inferd.agent.tools import CallLimits
from tests.agent.conftest import free_port

RECEIVED: list[tuple[str, dict[str, Any], str]] = []  # path, body, content type


class Dispatcher(BaseHTTPRequestHandler):
    """Answers by path: the shapes a dispatcher may send, and the ones it must not."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        RECEIVED.append((self.path, body, self.headers["Content-Type"]))
        args = body["arguments"]
        answers: dict[str, tuple[int, bytes]] = {
            "/string": (200, json.dumps(f"{body['name']}: {args}").encode()),
            "/object": (200, json.dumps({"content": {"sum": args.get("a", 0) + 1}}).encode()),
            "/tool-error": (
                200,
                json.dumps({"content": "no such city", "is_error": True}).encode(),
            ),
            "/status": (503, b'"busy"'),
            "/not-json": (200, b"<html>hello</html>"),
            "/wrong-shape": (200, b'{"result": 1}'),
            "/huge": (200, json.dumps("y" * (3 << 20)).encode()),
        }
        if self.path == "/slow":
            time.sleep(3)
            answers["/slow"] = (200, b'"late"')
        status, data = answers[self.path]
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        with contextlib.suppress(OSError):  # the client stopped reading (the size bound)
            self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Dispatcher)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def call(url: str, name: str, arguments: dict[str, Any], timeout_s: float = 10) -> Any:
    async def main() -> Any:
        source = DispatchTools(url, CallLimits(timeout_s, max_output_bytes=1024))
        await source.start()
        try:
            return await source.call(name, arguments)
        finally:
            await source.close()

    return asyncio.run(main())


def test_a_call_is_posted_as_name_and_arguments_and_a_string_answer_is_the_text(
    base_url: str,
) -> None:
    RECEIVED.clear()
    result = call(f"{base_url}/string", "get_weather", {"city": "Oslo"})
    assert (result.content, result.is_error) == ("get_weather: {'city': 'Oslo'}", False)
    assert RECEIVED == [
        ("/string", {"name": "get_weather", "arguments": {"city": "Oslo"}}, "application/json")
    ]


def test_a_content_object_is_shown_as_json_and_is_error_is_kept(base_url: str) -> None:
    assert call(f"{base_url}/object", "inc", {"a": 41}).content == '{"sum": 42}'
    failed = call(f"{base_url}/tool-error", "city", {})
    assert (failed.content, failed.is_error) == ("no such city", True)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/status", "answered HTTP 503"),
        ("/not-json", "is not JSON"),
        ("/wrong-shape", 'neither a string nor {"content": ...}'),
        ("/huge", "answer is over 1048576 bytes"),
    ],
)
def test_bad_answers_are_error_results(base_url: str, path: str, message: str) -> None:
    result = call(f"{base_url}{path}", "t", {})
    assert result.is_error and message in result.content


def test_a_slow_dispatcher_times_out_into_an_error(base_url: str) -> None:
    result = call(f"{base_url}/slow", "t", {}, timeout_s=0.5)
    assert result.is_error and "did not answer within 0.5 s" in result.content


def test_an_unreachable_dispatcher_is_an_error_result() -> None:
    result = call(f"http://127.0.0.1:{free_port()}/", "t", {})  # nothing listens there
    assert result.is_error and "failed" in result.content


def test_the_toolbox_routes_the_requests_own_tools_there(base_url: str) -> None:
    async def main() -> tuple[Any, Any]:
        box = ToolBox.from_config(AgentConfig(dispatch_url=f"{base_url}/string"))
        await box.start()
        try:
            ran = await box.call("client_tool", {"x": 1}, allowed={"client_tool"})
            refused = await box.call("other", {"x": 1}, allowed={"client_tool"})
            return ran, refused
        finally:
            await box.close()

    ran, refused = asyncio.run(main())
    assert ran.content == "client_tool: {'x': 1}"
    assert refused.is_error and "not available in this request" in refused.content


@pytest.mark.parametrize("url", ["ftp://example.com/x", "http:///nohost", "http://u:p@h/x"])
def test_a_bad_dispatch_url_is_a_config_error(url: str) -> None:
    with pytest.raises(AgentConfigError, match="--tool-dispatch-url"):
        AgentConfig(dispatch_url=url)
