"""The proof of issue 13 on the real 135M default model: 200 seeded requests per mode
(json_object, three json_schemas nesting 1, 3 and 5 objects deep, tools under required, a named
tool and auto) and every output that finishes parses and validates against its schema; then,
under greedy, ten prompts per mode streamed and not streamed give the same text and calls.

Cheap by design: one server with 32 running sequences takes all of a mode's requests at once
(continuous batching), the prompts share their prefix (the prefix cache holds the tools block),
and the schemas bound every string and array so an output is a few dozen tokens. Honest by
design: an output cut short by max_tokens finishes as "length" and is counted, not validated
(a prefix of valid JSON is not valid JSON); the test asserts that every one that finishes is
valid, and that nearly all finish where the schema bounds the output (MIN_FINISHED).
``INFERD_PROOF_N`` and ``INFERD_PROOF_GREEDY`` lower the 200 and 10 for a quick local run.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from tests.server.live import LiveServer, live_server

REQUESTS = int(os.environ.get("INFERD_PROOF_N", "200"))
GREEDY = int(os.environ.get("INFERD_PROOF_GREEDY", "10"))  # prompts per mode, streamed vs not
SEQS = 64  # the proof server's running sequences, and the client's concurrency
MAX_TOKENS = 160
# Share of a mode's outputs that must end before max_tokens. Where the schema bounds every
# string and array the output is short: nearly all must finish. json_object bounds nothing and
# the 135M model can write on to max_tokens (5 of 16 in a small run): half must finish, which
# shows the test is not vacuous. auto leaves the text free until a call, and the model mostly
# answers in prose that runs to max_tokens (13 of 16, no call): nothing is asked of its share
# (its text is cut at AUTO_MAX_TOKENS to keep the run cheap); every call it makes must validate.
MIN_FINISHED = {"json_object": 0.5, "auto": 0.0}
AUTO_MAX_TOKENS = 64
# The greedy comparison asks whether streaming changes the text, which a reply cut at
# max_tokens shows as well as a finished one: its replies stop at 64 tokens to keep it cheap.
GREEDY_MAX_TOKENS = 64

_NAME = {"type": "string", "minLength": 1, "maxLength": 16}
_TAGS = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}


def _obj(**props: Any) -> dict[str, Any]:
    """A closed object: every property required, no others."""
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


# Nesting depth counts objects: depth 1 is flat, depth 5 is an object five levels down.
DEPTH1 = _obj(
    name=_NAME,
    age={"type": "integer", "minimum": 0, "maximum": 120},
    member={"type": "boolean"},
    color={"enum": ["red", "green", "blue"]},
)
DEPTH3 = _obj(
    order=_obj(
        id={"type": "integer", "minimum": 1, "maximum": 9999},
        customer=_obj(name=_NAME, vip={"type": "boolean"}),
        tags=_TAGS,
    ),
    total={"type": "number", "minimum": 0, "maximum": 1000},
)
DEPTH5 = _obj(
    company=_obj(
        name=_NAME,
        office=_obj(
            city=_NAME,
            team=_obj(
                lead=_NAME,
                member=_obj(name=_NAME, level={"type": "integer", "minimum": 1, "maximum": 5}),
                size={"type": "integer", "minimum": 1, "maximum": 50},
            ),
        ),
        tags=_TAGS,
    ),
)
SCHEMAS = {"depth1": DEPTH1, "depth3": DEPTH3, "depth5": DEPTH5}

WEATHER = _obj(city=_NAME, unit={"enum": ["celsius", "fahrenheit"]})
BOOKING = _obj(
    guest=_obj(name=_NAME, adults={"type": "integer", "minimum": 1, "maximum": 6}),
    room={"enum": ["single", "double", "suite"]},
    nights={"type": "integer", "minimum": 1, "maximum": 14},
)
TOOL_SCHEMAS = {"get_weather": WEATHER, "book_room": BOOKING}
TOOLS = [
    {
        "type": "function",
        "function": {"name": n, "description": f"{n.replace('_', ' ')}", "parameters": s},
    }
    for n, s in TOOL_SCHEMAS.items()
]

# Ten prompts: greedy needs different ones to differ; sampling varies the rest by seed.
JSON_PROMPTS = [
    "Describe a person as JSON.",
    "Give me a customer record as JSON.",
    "Make up a small company profile in JSON.",
    "Return a JSON object about a pet.",
    "Invent an order from an online shop, as JSON.",
    "Write a JSON record for a football player.",
    "Output a JSON object describing a team.",
    "JSON for a library member, please.",
    "A fictional employee as a JSON object.",
    "Reply with a JSON object describing a city.",
]
TOOL_PROMPTS = [
    "What is the weather in Paris right now?",
    "Book a double room for two adults for three nights.",
    "Is it raining in Tokyo?",
    "I need a suite for one person, a week long.",
    "How warm is it in Berlin in fahrenheit?",
    "Reserve a single room for Anna for two nights.",
    "Tell me the weather in Madrid.",
    "Book me a room, please.",
    "Should I take an umbrella in London today?",
    "Find a room for a family of four for five nights.",
]


@dataclass(frozen=True)
class Mode:
    name: str
    prompts: list[str]
    extra: dict[str, Any]

    @property
    def tools(self) -> bool:
        return "tools" in self.extra


def _format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


MODES = [
    Mode("json_object", JSON_PROMPTS, {"response_format": {"type": "json_object"}}),
    *(Mode(n, JSON_PROMPTS, {"response_format": _format(n, s)}) for n, s in SCHEMAS.items()),
    # One call a reply where the call is forced: left to chain calls, the 135M model writes
    # them until max_tokens (the chaining itself is tested in test_tools_live.py).
    Mode(
        "required",
        TOOL_PROMPTS,
        {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
    ),
    Mode(
        "named",
        TOOL_PROMPTS,
        {
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "book_room"}},
            "parallel_tool_calls": False,
        },
    ),
    Mode("auto", TOOL_PROMPTS, {"tools": TOOLS, "tool_choice": "auto"}),
]


@dataclass
class Reply:
    """One choice as the client saw it, streamed or not."""

    finish: str
    content: str | None
    calls: list[tuple[str, str]]  # (name, arguments JSON text)
    tokens: int = field(default=0, compare=False)  # completion tokens (non-streamed only)


@dataclass
class Tally:
    finishes: Counter[str] = field(default_factory=Counter)
    calls: int = 0
    invalid: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def proof_server(
    smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """The default model at the default dtype, with room for a wave of requests at once.
    (The greedy comparison runs on the shared float32 ``server``, whose greedy text does not
    depend on what else is in the batch.)"""
    log = tmp_path_factory.mktemp("proof") / "serve.log"
    args = ["-m", str(smollm2_gguf), "--max-seqs", str(SEQS)]
    args += ["--max-seq-len", "1024", "--max-waiting", "1024"]
    with live_server(args, log, startup_timeout=600) as live:  # bf16 prepacking, on a busy CI
        yield live


def _body(mode: Mode, prompt: str, **sampling: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": AUTO_MAX_TOKENS if mode.name == "auto" else MAX_TOKENS,
        **mode.extra,
        **sampling,
    }


async def _complete(client: httpx.AsyncClient, body: dict[str, Any]) -> Reply:
    r = await client.post("/chat/completions", json=body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    message = choice["message"]
    calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []
    ]
    tokens = r.json()["usage"]["completion_tokens"]
    return Reply(choice["finish_reason"], message.get("content"), calls, tokens)


async def _stream(client: httpx.AsyncClient, body: dict[str, Any]) -> Reply:
    content: list[str] = []
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    finish = None
    async with client.stream("POST", "/chat/completions", json=body | {"stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                delta = choice["delta"]
                content.append(delta.get("content") or "")
                for call in delta.get("tool_calls") or ():
                    i = call["index"]
                    if "id" in call:  # the first piece of a call names it, once
                        assert i not in names
                        names[i] = call["function"]["name"]
                    args[i] = args.get(i, "") + call["function"].get("arguments", "")
                finish = choice.get("finish_reason") or finish
    assert finish is not None
    text = "".join(content)
    return Reply(finish, text or None, [(names[i], args[i]) for i in sorted(names)])


async def _gather(
    server: LiveServer, bodies: list[dict[str, Any]], stream: bool = False
) -> list[Reply]:
    gate = asyncio.Semaphore(SEQS)
    limits = httpx.Limits(max_connections=SEQS)
    async with httpx.AsyncClient(base_url=server.api, timeout=600, limits=limits) as client:

        async def one(body: dict[str, Any]) -> Reply:
            async with gate:
                return await (_stream if stream else _complete)(client, body)

        return await asyncio.gather(*(one(b) for b in bodies))


def _check(mode: Mode, reply: Reply, tally: Tally) -> None:
    """Count the reply's ending; every finished output and every emitted call must validate."""
    tally.finishes[reply.finish] += 1
    problem = None
    if not mode.tools:
        assert not reply.calls
        if reply.finish == "stop":
            problem = _invalid(reply.content, SCHEMAS.get(mode.name, {"type": "object"}))
    else:
        problem = _check_calls(mode, reply)
        tally.calls += len(reply.calls)
    if problem is not None:
        tally.invalid.append(f"{problem}: {reply}")


def _check_calls(mode: Mode, reply: Reply) -> str | None:
    if reply.finish == "tool_calls" and not reply.calls:
        return "tool_calls without a call"
    if reply.calls and reply.finish not in ("tool_calls", "length"):
        return f"calls ending {reply.finish}"
    if mode.name != "auto":  # the whole reply is calls: only a cut-short one has none
        if reply.finish not in ("tool_calls", "length") or reply.content:
            return "a forced call ended otherwise"
    elif "<tool_call>" in (reply.content or ""):
        return "a call left in the content"
    for name, arguments in reply.calls:
        if mode.name == "named" and name != "book_room":
            return f"called {name}, not the named tool"
        if name not in TOOL_SCHEMAS:
            return f"unknown tool {name}"
        problem = _invalid(arguments, TOOL_SCHEMAS[name])
        if problem is not None:
            return problem
    return None


def _invalid(text: str | None, schema: dict[str, Any]) -> str | None:
    try:
        jsonschema.validate(json.loads(text or ""), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
        return f"invalid ({type(exc).__name__}: {str(exc).splitlines()[0]})"
    return None


@pytest.mark.parametrize("mode", MODES, ids=[m.name for m in MODES])
def test_every_finished_output_validates(proof_server: LiveServer, mode: Mode) -> None:
    bodies = [
        _body(mode, mode.prompts[seed % len(mode.prompts)], seed=seed, temperature=0.9)
        for seed in range(REQUESTS)
    ]
    replies = asyncio.run(_gather(proof_server, bodies))
    tally = Tally()
    for reply in replies:
        _check(mode, reply, tally)
    tokens = sorted(r.tokens for r in replies)
    print(  # the figures the report quotes (pytest -s)
        f"\n{mode.name}: {dict(tally.finishes)} calls={tally.calls} "
        f"tokens={sum(tokens)} median={tokens[len(tokens) // 2]} max={tokens[-1]}"
    )
    assert not tally.invalid, tally.invalid[:5]
    finished = REQUESTS - tally.finishes["length"]
    assert finished >= MIN_FINISHED.get(mode.name, 0.95) * REQUESTS, tally.finishes
    if mode.tools and mode.name != "auto":
        assert tally.finishes["tool_calls"] == finished  # every finished forced reply calls
    # The seeds differ: so do the outputs (a constraint that collapsed them would not show).
    assert len({(r.content, tuple(r.calls)) for r in replies}) > REQUESTS // 2


@pytest.mark.parametrize("mode", MODES, ids=[m.name for m in MODES])
def test_streamed_equals_non_streamed_under_greedy(server: LiveServer, mode: Mode) -> None:
    bodies = [
        _body(mode, p, temperature=0, max_tokens=GREEDY_MAX_TOKENS) for p in mode.prompts[:GREEDY]
    ]
    whole = asyncio.run(_gather(server, bodies))
    streamed = asyncio.run(_gather(server, bodies, stream=True))
    tally = Tally()
    for a, b in zip(whole, streamed, strict=True):
        assert b == a
        _check(mode, a, tally)
    assert not tally.invalid, tally.invalid
