"""Image and speech generation, which inferd does not serve, answer 501 in OpenAI's envelope
saying so (not a bare 404), through the official SDK as a client would call them."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from inferd.server.app import build_app


def _client() -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=build_app())
    http = httpx.AsyncClient(transport=transport, base_url="http://test/v1")
    return openai.AsyncOpenAI(api_key="x", base_url="http://test/v1", http_client=http)


def _refusal(call: str) -> openai.APIStatusError:
    async def run() -> openai.APIStatusError:
        client = _client()
        try:
            if call == "images.generate":
                await client.images.generate(prompt="a cat", model="any")
            elif call == "images.edit":
                await client.images.edit(image=("cat.png", b"\x89PNG"), prompt="a hat")
            else:
                await client.audio.speech.create(model="any", voice="alloy", input="Hello")
        except openai.APIStatusError as exc:
            return exc
        finally:
            await client.close()
        raise AssertionError(f"{call} succeeded")

    return asyncio.run(run())


@pytest.mark.parametrize(
    ("call", "what"),
    [
        ("images.generate", "image generation"),
        ("images.edit", "image editing"),
        ("audio.speech", "speech synthesis"),
    ],
)
def test_a_kind_inferd_does_not_serve_is_501_saying_so(call: str, what: str) -> None:
    exc = _refusal(call)
    assert exc.status_code == 501
    error = exc.response.json()["error"]
    assert error["code"] == "model_kind_not_served"
    assert error["message"].startswith(f"{what} is not served by inferd")
    assert "chat" in error["message"]


def test_the_unprefixed_route_answers_the_same() -> None:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/images/generations", json={"prompt": "a cat"})

    response = asyncio.run(run())
    assert response.status_code == 501
    assert response.json()["error"]["code"] == "model_kind_not_served"
