"""The Responses API's hosted ``mcp`` tool through the real CLI: a request names an MCP server
(the test server over streamable HTTP on loopback, its calls logged to a file), allowed by
``--mcp-allow-url``; the server connects, lists its tools, runs the model's calls and answers,
with OpenAI's ``mcp_list_tools`` and ``mcp_call`` items. Driven by the openai SDK (strict), by
raw HTTP checked against OpenAI's spec, and by the openai-agents SDK's ``HostedMCPTool``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.agent.conftest import SERVER_SCRIPT, free_port, wait_for_port
from tests.server.live import LiveServer, live_server
from tests.server.spec_check import check_openai, check_responses_event, parse_sse

QUESTION = "What is the capital of Peru?"


@pytest.fixture(scope="module")
def calls_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hosted-calls") / "calls.jsonl"


@pytest.fixture(scope="module")
def mcp_url(calls_log: Path) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(SERVER_SCRIPT), "http", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=os.environ | {"MCP_CALL_LOG": str(calls_log)},
    )
    try:
        wait_for_port(port, proc)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}/mcp"  # allowed, but nothing listens there


@pytest.fixture(scope="module")
def server(
    smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory, mcp_url: str, dead_url: str
) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("hosted-mcp") / "serve.log"
    args = ["-m", str(smollm2_gguf)]
    for allowed in (mcp_url, dead_url, "http://169.254.169.254"):
        args += ["--mcp-allow-url", allowed]
    with live_server(args, log) as live:
        yield live


def _tool(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "mcp", "server_label": "calc", "server_url": url} | extra


def _ask(url: str) -> dict[str, Any]:
    return {
        "model": "default",
        "input": QUESTION,
        "temperature": 0,
        "tools": [_tool(url, require_approval="never", allowed_tools=["add", "lookup"])],
        "tool_choice": {"type": "mcp", "server_label": "calc", "name": "lookup"},
        "max_tool_rounds": 1,
    }


def _calls(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_a_request_named_server_is_listed_called_and_answered(
    server: LiveServer, mcp_url: str, calls_log: Path
) -> None:
    before = len(_calls(calls_log))
    raw = httpx.post(server.api + "/responses", json=_ask(mcp_url), timeout=120).json()
    check_openai("Response", raw)
    client = openai.OpenAI(
        base_url=server.api, api_key="unused", max_retries=0, _strict_response_validation=True
    )
    response = client.responses.retrieve(raw["id"])
    listing, call, answer = response.output
    assert listing.type == "mcp_list_tools" and listing.server_label == "calc"
    assert sorted(t.name for t in listing.tools) == ["add", "lookup"]  # allowed_tools
    assert call.type == "mcp_call" and (call.name, call.server_label) == ("lookup", "calc")
    (ran,) = _calls(calls_log)[before:]
    assert ran["tool"] == "lookup" and json.loads(call.arguments) == ran["arguments"]
    assert answer.type == "message" and response.status == "completed"
    (echoed,) = raw["tools"]
    assert echoed["type"] == "mcp" and echoed["headers"] is None

    body = httpx.post(
        server.api + "/responses", json=_ask(mcp_url) | {"stream": True}, timeout=120
    ).text
    events = [json.loads(e.data) for e in parse_sse(body)]
    for event in events:
        check_responses_event(event)
    kinds = [e["type"] for e in events]
    assert kinds[2:5] == [
        "response.output_item.added",
        "response.mcp_list_tools.in_progress",
        "response.mcp_list_tools.completed",
    ]
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["mcp_list_tools", "mcp_call", "message"]
    assert final["output"][2] == raw["output"][2] | {"id": final["output"][2]["id"]}


def _run_agent(server: LiveServer, tool_config: dict[str, Any], **tool: Any) -> Any:
    """An openai-agents run over the Responses API with one HostedMCPTool, the first call
    forced (the 135M model answers without it otherwise), one call at a time."""
    from agents import Agent, HostedMCPTool, ModelSettings, Runner, set_tracing_disabled
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=server.api, api_key="unused", max_retries=0)
    agent = Agent(
        name="capitals",
        instructions="Answer with the lookup tool.",
        tools=[HostedMCPTool(tool_config=tool_config, **tool)],  # type: ignore[arg-type]
        model=OpenAIResponsesModel(model="default", openai_client=client),
        model_settings=ModelSettings(
            tool_choice="required",
            parallel_tool_calls=False,  # one call (with parallel calls it makes two)
            temperature=0,
            extra_body={"max_tool_rounds": 1},
        ),
    )

    async def run() -> Any:
        try:
            return await Runner.run(agent, QUESTION, max_turns=4)
        finally:
            await client.close()

    return asyncio.run(run())


def test_the_agents_sdk_drives_a_hosted_mcp_tool(
    server: LiveServer, mcp_url: str, calls_log: Path
) -> None:
    before = len(_calls(calls_log))
    result = _run_agent(server, _tool(mcp_url, require_approval="never", allowed_tools=["lookup"]))
    assert [c["tool"] for c in _calls(calls_log)[before:]] == ["lookup"]
    kinds = [item.type for item in result.new_items]
    assert "mcp_list_tools_item" in kinds and "message_output_item" in kinds
    assert isinstance(result.final_output, str) and result.final_output


@pytest.mark.parametrize(
    ("url", "status", "code"),
    [
        ("http://169.254.169.254/mcp", 400, "mcp_server_url_refused"),  # allowed, yet never
        ("http://127.0.0.1:9/mcp", 400, "mcp_server_url_refused"),  # no pattern allows it
        ("file:///etc/passwd", 400, "mcp_server_url_refused"),
    ],
)
def test_a_server_url_the_policy_refuses_is_a_400(
    server: LiveServer, url: str, status: int, code: str
) -> None:
    body = {"input": QUESTION, "tools": [_tool(url, require_approval="never")]}
    reply = httpx.post(server.api + "/responses", json=body, timeout=60)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["code"] == code and error["param"] == "tools.0.server_url"


def test_an_unreachable_server_is_a_424(server: LiveServer, dead_url: str) -> None:
    body = {"input": QUESTION, "tools": [_tool(dead_url, require_approval="never")]}
    reply = httpx.post(server.api + "/responses", json=body, timeout=60)
    assert reply.status_code == 424, reply.text
    assert reply.json()["error"]["code"] == "mcp_server_unavailable"


def test_bad_mcp_fields_are_400s(server: LiveServer, mcp_url: str) -> None:
    bad = [
        _tool(mcp_url, server_label="has space"),
        _tool(mcp_url, require_approval="sometimes"),
        _tool(mcp_url, allowed_tools="lookup"),
        {"type": "mcp", "server_label": "calc"},
    ]
    for tool in bad:
        reply = httpx.post(server.api + "/responses", json={"input": "hi", "tools": [tool]})
        assert reply.status_code == 400, (tool, reply.text)


# -- approvals: asked in the reply, answered in the next request -----------------------------


def _asking(url: str) -> dict[str, Any]:
    return _ask(url) | {"tools": [_tool(url, allowed_tools=["lookup"])]}  # always: the default


@pytest.mark.parametrize("approve", [True, False])
def test_a_call_needing_approval_is_asked_then_answered(
    server: LiveServer, mcp_url: str, calls_log: Path, approve: bool
) -> None:
    before = len(_calls(calls_log))
    asked = httpx.post(server.api + "/responses", json=_asking(mcp_url), timeout=120).json()
    check_openai("Response", asked)
    assert [i["type"] for i in asked["output"]] == ["mcp_list_tools", "mcp_approval_request"]
    request = asked["output"][1]
    assert (request["name"], request["server_label"]) == ("lookup", "calc")
    assert _calls(calls_log)[before:] == []  # nothing ran yet

    answer = {"type": "mcp_approval_response", "approval_request_id": request["id"]}
    follow = {
        "model": "default",
        "previous_response_id": asked["id"],
        "input": [answer | {"approve": approve}],
        "temperature": 0,
        "max_output_tokens": 40,
        "tools": [_tool(mcp_url, allowed_tools=["lookup"], require_approval="never")],
        "max_tool_rounds": 1,
    }
    done = httpx.post(server.api + "/responses", json=follow, timeout=120).json()
    check_openai("Response", done)
    call = done["output"][1]
    assert call["type"] == "mcp_call" and call["approval_request_id"] == request["id"]
    assert call["arguments"] == request["arguments"] and done["output"][-1]["type"] == "message"
    ran = [c["tool"] for c in _calls(calls_log)[before:]]
    if approve:
        assert ran[:1] == ["lookup"] and call["output"]
    else:
        assert "lookup" not in ran[:1] and call["status"] == "failed"
        assert "did not approve" in call["output"]

    again = httpx.post(
        server.api + "/responses",
        json=follow | {"input": [answer | {"approve": True, "approval_request_id": "mcpr_none"}]},
        timeout=60,
    )
    assert again.status_code == 400 and "approval_request_id" in again.json()["error"]["param"]


def test_the_agents_sdk_approves_a_hosted_mcp_call(
    server: LiveServer, mcp_url: str, calls_log: Path
) -> None:
    asked: list[str] = []

    def approve(request: Any) -> Any:
        asked.append(request.data.name)
        return {"approve": True}

    before = len(_calls(calls_log))
    config = _tool(mcp_url, require_approval="always", allowed_tools=["lookup"])
    result = _run_agent(server, config, on_approval_request=approve)
    assert asked and set(asked) == {"lookup"}
    assert [c["tool"] for c in _calls(calls_log)[before:]] == ["lookup"] * len(asked)
    assert isinstance(result.final_output, str)
