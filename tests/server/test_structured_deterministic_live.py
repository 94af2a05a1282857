"""Constraints under ``--deterministic``, live: a json_schema reply and a required tool call,
each sampled at temperature 0.8 with a seed, come out bit for bit the same (text, tool-call
arguments and logprobs) on a retry and when they share every step with eight other streams,
and each validates. The server runs in bf16 where the CPU has it, batch-invariant kernels on."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.server.live import LiveServer, live_server
from tests.server.tool_fixtures import weather_and_time

FORECAST = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "high": {"type": "integer", "minimum": -50, "maximum": 60},
        "sky": {"enum": ["clear", "cloudy", "rain"]},
    },
    "required": ["city", "high", "sky"],
    "additionalProperties": False,
}
WEATHER = weather_and_time(30)[0]["get_weather"]
TOOL: Any = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
OTHERS = 8


@pytest.fixture(scope="module")
def deterministic_server(
    smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("serve-deterministic") / "serve.log"
    args = ["-m", str(smollm2_gguf), "--deterministic", "--max-seqs", str(OTHERS + 2)]
    with live_server([*args, "--max-seq-len", "1024"], log) as live:
        yield live


def _sampled(seed: int) -> dict[str, Any]:
    return {"model": "default", "temperature": 0.8, "seed": seed, "max_tokens": 40}


async def _schema_reply(client: openai.AsyncOpenAI) -> tuple[str, list[float]]:
    reply = await client.chat.completions.create(
        messages=[{"role": "user", "content": "Tomorrow's forecast for Oslo?"}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "forecast", "schema": FORECAST, "strict": True},
        },
        logprobs=True,
        **_sampled(11),
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content
    jsonschema.validate(json.loads(choice.message.content), FORECAST)
    assert choice.logprobs is not None and choice.logprobs.content is not None
    return choice.message.content, [t.logprob for t in choice.logprobs.content]


async def _tool_reply(client: openai.AsyncOpenAI) -> list[tuple[str, str]]:
    reply = await client.chat.completions.create(
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[TOOL],
        tool_choice="required",
        **_sampled(12),
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    for name, arguments in calls:
        assert name == "get_weather"
        jsonschema.validate(json.loads(arguments), WEATHER)
    return calls


async def _both(client: openai.AsyncOpenAI) -> tuple[Any, Any]:
    return await asyncio.gather(_schema_reply(client), _tool_reply(client))


async def _beside_others(client: openai.AsyncOpenAI) -> tuple[Any, Any]:
    """Both requests, sent once every other stream has produced its first token, so each of
    their steps shares the batch with (and is shaped by) eight unconstrained sequences."""
    started = [asyncio.Event() for _ in range(OTHERS)]

    async def other(i: int) -> int:
        stream = await client.chat.completions.create(
            messages=[{"role": "user", "content": f"Write a long story about ship number {i}."}],
            stream=True,
            extra_body={"ignore_eos": True},  # they outlast the requests under test
            **(_sampled(100 + i) | {"max_tokens": 400}),
        )
        chunks = 0
        async with stream:  # closing it (when cancelled) disconnects, which aborts it
            async for _ in stream:
                chunks += 1
                started[i].set()
        return chunks

    others = [asyncio.create_task(other(i)) for i in range(OTHERS)]
    for event, task in zip(started, others, strict=True):
        waiter = asyncio.ensure_future(event.wait())
        await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
        if not event.is_set():  # the stream ended or failed before its first token
            waiter.cancel()
            raise AssertionError(f"another stream produced nothing: {task.result()} chunks")
    both = await _both(client)
    still_running = sum(not t.done() for t in others)
    for task in others:  # their own output is not under test: stop them now
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)
    assert still_running == OTHERS, "the other streams ended before the constrained requests"
    return both


def test_constrained_replies_are_bit_identical_alone_retried_and_in_a_crowd(
    deterministic_server: LiveServer,
) -> None:
    async def run() -> list[tuple[Any, Any]]:
        client = openai.AsyncOpenAI(base_url=deterministic_server.api, api_key="x", max_retries=0)
        try:
            return [await _both(client), await _both(client), await _beside_others(client)]
        finally:
            await client.close()

    alone, retry, crowded = asyncio.run(run())
    assert retry == alone
    assert crowded == alone
