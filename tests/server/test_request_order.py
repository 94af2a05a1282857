"""Cheap checks come before costly work: a request with an invalid field and a remote image is
refused without the image ever being fetched, on every protocol that takes images (chat
completions, Anthropic messages, the Responses API). The image server counts its fetches; the
served model is the real one, declared able to take images (as test_media_decode does)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import httpx
import pytest

from inferd.contract.fixtures import tiny_png
from inferd.server.app import build_app
from inferd.server.media import MediaPolicy, Modalities
from inferd.server.options import ServerOptions
from inferd.serving.served import ServedModel


class SeeingModel(ServedModel):
    modalities: ClassVar[Modalities] = Modalities(("text", "image"))


@dataclasses.dataclass
class ImageServer:
    port: int
    fetches: int = 0


def _image_part(url: str, protocol: str) -> dict[str, Any]:
    if protocol == "anthropic":
        return {"type": "image", "source": {"type": "url", "url": url}}
    if protocol == "responses":
        return {"type": "input_image", "image_url": url}
    return {"type": "image_url", "image_url": {"url": url}}


def _body(protocol: str, url: str, invalid: dict[str, Any], model: str) -> dict[str, Any]:
    text = {"responses": "input_text", "anthropic": "text"}.get(protocol, "text")
    content = [{"type": text, "text": "What is this?"}, _image_part(url, protocol)]
    message = [{"role": "user", "content": content}]
    if protocol == "responses":
        return {"model": model, "input": message, **invalid}
    return {"model": model, "messages": message, "max_tokens": 4, **invalid}


PATHS = {"chat": "/v1/chat/completions", "anthropic": "/v1/messages", "responses": "/v1/responses"}
# (protocol, an invalid field, what the 400 names)
CASES = [
    ("chat", {"temperature": 3.5}, "temperature"),
    ("chat", {"n": 0}, "n"),
    ("chat", {"logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ("chat", {"top_p": 1.5}, "top_p"),
    ("anthropic", {"temperature": 1.5}, "temperature"),
    ("anthropic", {"top_k": -2}, "top_k"),
    ("anthropic", {"thinking": {"type": "sometimes"}}, "thinking.type"),
    ("anthropic", {"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp"),
    ("responses", {"temperature": 3.5}, "temperature"),
    ("responses", {"top_p": -1}, "top_p"),
]


@pytest.fixture(scope="module")
def image_server() -> Iterator[ImageServer]:
    png = tiny_png()
    counter = ImageServer(0)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            counter.fetches += 1
            self.send_response(200)
            self.send_header("content-type", "image/png")
            self.send_header("content-length", str(len(png)))
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    counter.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield counter
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture(scope="module")
def app(served_f32: ServedModel, image_server: ImageServer) -> Any:
    seeing = SeeingModel(
        **{f.name: getattr(served_f32, f.name) for f in dataclasses.fields(served_f32)}
    )
    policy = MediaPolicy.create(
        allow_remote=True, remote_ports=[image_server.port], allow_networks=["127.0.0.0/8"]
    )
    return build_app([seeing], ServerOptions(media_policy=policy))


def _post(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        headers = {"anthropic-version": "2023-06-01"}
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body, headers=headers, timeout=120)

    return asyncio.run(run())


@pytest.mark.parametrize(("protocol", "invalid", "param"), CASES)
def test_an_invalid_field_is_refused_before_any_image_is_fetched(
    app: Any,
    image_server: ImageServer,
    served_f32: ServedModel,
    protocol: str,
    invalid: dict[str, Any],
    param: str,
) -> None:
    url = f"http://127.0.0.1:{image_server.port}/cat.png"
    before = image_server.fetches
    response = _post(app, PATHS[protocol], _body(protocol, url, invalid, served_f32.id))
    assert response.status_code == 400, response.text
    assert param in response.text
    assert image_server.fetches == before, f"{protocol} fetched the image before checking {param}"


def test_a_valid_request_does_fetch_the_image(
    app: Any, image_server: ImageServer, served_f32: ServedModel
) -> None:
    """The counter counts: the same requests without the invalid field fetch the image (the
    text-only template then refuses the image part: that is not what is checked here)."""
    url = f"http://127.0.0.1:{image_server.port}/cat.png"
    for protocol, path in PATHS.items():
        before = image_server.fetches
        response = _post(app, path, _body(protocol, url, {}, served_f32.id))
        assert image_server.fetches == before + 1, (protocol, response.text)
