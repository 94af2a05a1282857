"""The agent loop through the real CLI (`inferd serve --mcp-config ...`) on the default model:
a real MCP server (tests/agent/mcp_servers.py, over stdio) whose calls are logged to a file,
official SDKs with strict response validation, greedy decoding so each answer reproduces.

The model is forced to call a server tool in the first round (``tool_choice`` naming it); the
server runs the call and generates again with ``auto``, and the client sees the answer only.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.agent.conftest import SERVER_SCRIPT
from tests.agent.mcp_servers import CAPITALS
from tests.server.live import LiveServer, live_server
from tests.server.spec_check import check_openai, check_responses_event, parse_sse

PERU = [{"role": "user", "content": "What is the capital of Peru?"}]
LOOKUP = {"type": "function", "function": {"name": "lookup"}}
APPROVAL_TIMEOUT_S = 3
OWN_TOOL = {  # a tool the client runs
    "type": "function",
    "function": {
        "name": "local_clock",
        "description": "The time on the user's machine.",
        "parameters": {"type": "object", "properties": {}},
    },
}
TOOL_TIMEOUT_S = 10


@pytest.fixture(scope="module")
def calls_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("agent-calls") / "calls.jsonl"


@pytest.fixture(scope="module")
def server(
    smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory, calls_log: Path
) -> Iterator[LiveServer]:
    folder = tmp_path_factory.mktemp("agent-loop")
    config = {
        "mcpServers": {
            "calc": {
                "command": sys.executable,
                "args": [str(SERVER_SCRIPT), "stdio"],
                "env": {"MCP_CALL_LOG": str(calls_log)},
                "permission": "allow",
                "timeout_s": TOOL_TIMEOUT_S,
                "tools": {
                    "multiply": {"permission": "ask"},
                    "authorization": {"permission": "deny"},
                },
            }
        },
        "max_output_bytes": 4096,
    }
    (folder / "mcp.json").write_text(json.dumps(config))
    args = [
        "-m",
        str(smollm2_gguf),
        "--mcp-config",
        str(folder / "mcp.json"),
        "--agent-approval-timeout",
        str(APPROVAL_TIMEOUT_S),
        "--max-tool-rounds",
        "3",
    ]
    with live_server(args, folder / "serve.log") as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.api, api_key="unused", max_retries=0, _strict_response_validation=True
    )


def _calls(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]


def _new_calls(log: Path, before: int) -> list[dict[str, Any]]:
    return _calls(log)[before:]


def _lookup_answer(call: dict[str, Any]) -> str:
    """What the test server's lookup answers to ``call`` (the model picks the argument)."""
    country = call["arguments"]["country"]
    return CAPITALS.get(country.strip().lower(), f"no capital known for {country!r}")


def _chat(client: openai.OpenAI, **extra: Any) -> Any:
    ask: dict[str, Any] = {"model": "default", "messages": PERU, "temperature": 0}
    return client.chat.completions.create(**(ask | extra))


def test_the_startup_lines_list_the_servers_tools(server: LiveServer) -> None:
    text = server.log.read_text()
    assert "inferd  tools      mcp calc" in text
    assert "lookup [allow]" in text and "multiply [ask]" in text


def test_chat_runs_the_tool_and_answers_with_its_result(
    client: openai.OpenAI, calls_log: Path
) -> None:
    before = len(_calls(calls_log))
    reply = _chat(client, tool_choice=LOOKUP, extra_body={"max_tool_rounds": 1})
    choice = reply.choices[0]
    (call,) = _new_calls(calls_log, before)
    assert call["tool"] == "lookup"
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert _lookup_answer(call) in (choice.message.content or "")  # the model read the result


def test_usage_counts_every_round(client: openai.OpenAI, calls_log: Path) -> None:
    """A reply cut at one token ends the loop in its first round: its prompt is the first
    round's. The loop's usage holds that prompt and the longer second one."""
    before = len(_calls(calls_log))
    first_round = _chat(client, tool_choice=LOOKUP, max_tokens=1).usage
    assert first_round is not None and _new_calls(calls_log, before) == []
    looped = _chat(client, tool_choice=LOOKUP, extra_body={"max_tool_rounds": 1}).usage
    assert looped is not None
    assert looped.prompt_tokens > 2 * first_round.prompt_tokens
    assert looped.total_tokens == looped.prompt_tokens + looped.completion_tokens


def test_a_stream_carries_the_final_answer_only(client: openai.OpenAI) -> None:
    whole = _chat(client, tool_choice=LOOKUP, extra_body={"max_tool_rounds": 1})
    stream = _chat(
        client,
        tool_choice=LOOKUP,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"max_tool_rounds": 1},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
    assert text == whole.choices[0].message.content  # the same greedy answer
    assert chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def _agent_events(events: list[Any]) -> list[dict[str, Any]]:
    """The progress events of a stream, each checked to be named by its type."""
    notes = [e for e in events if e.name and e.name.startswith("agent_")]
    for note in notes:
        assert json.loads(note.data)["type"] == note.name
    return [json.loads(note.data) for note in notes]


def test_a_stream_that_asks_shows_each_call_and_result_before_the_answer(
    server: LiveServer, client: openai.OpenAI, calls_log: Path
) -> None:
    """``agent_progress``: the rounds' ``agent_tool_call`` and ``agent_tool_result`` events
    come first, naming the call the server ran and its result; the answer after them is the
    one a stream without them gives."""
    ask = {"model": "default", "messages": PERU, "temperature": 0, "tool_choice": LOOKUP}
    ask |= {"max_tool_rounds": 1, "stream": True}
    plain = httpx.post(server.api + "/chat/completions", json=ask, timeout=120)
    assert _agent_events(parse_sse(plain.text)) == []  # not asked: none
    before = len(_calls(calls_log))
    shown = httpx.post(
        server.api + "/chat/completions", json=ask | {"agent_progress": True}, timeout=120
    )
    assert shown.status_code == 200
    events = parse_sse(shown.text)
    (call,) = _new_calls(calls_log, before)
    started, result = _agent_events(events)
    assert events[:2] == [e for e in events if e.name]  # before the answer's first chunk
    assert started["type"] == "agent_tool_call" and started["name"] == "lookup"
    assert json.loads(started["arguments"]) == call["arguments"]
    assert result["type"] == "agent_tool_result" and result["call_id"] == started["call_id"]
    assert (result["round"], result["is_error"]) == (1, False)
    assert result["output"] == _lookup_answer(call) and not result["output_truncated"]
    assert [e.data for e in events[2:]] != [] and events[-1].data == "[DONE]"

    def answer(events: list[Any]) -> str:
        chunks = [json.loads(e.data) for e in events if not e.name and e.data != "[DONE]"]
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)

    assert answer(events) == answer(parse_sse(plain.text)) != ""


def test_anthropic_messages_run_the_loop(server: LiveServer, calls_log: Path) -> None:
    sdk = anthropic.Anthropic(
        base_url=server.url, api_key="unused", max_retries=0, _strict_response_validation=True
    )
    ask: dict[str, Any] = {
        "model": "default",
        "max_tokens": 100,
        "messages": PERU,
        "extra_body": {"temperature": 0},  # this SDK version takes no temperature argument
        "tool_choice": {"type": "tool", "name": "lookup"},
    }
    before = len(_calls(calls_log))
    message = sdk.messages.create(**ask)
    (call,) = _new_calls(calls_log, before)
    assert call["tool"] == "lookup" and message.stop_reason == "end_turn"
    text = "".join(b.text for b in message.content if b.type == "text")
    assert _lookup_answer(call) in text
    with sdk.messages.stream(**ask) as stream:
        streamed = stream.get_final_message()
    assert "".join(b.text for b in streamed.content if b.type == "text") == text
    assert streamed.usage.input_tokens == message.usage.input_tokens
    # Asked for (never by the SDK, whose strict parser knows no such event), the progress
    # events come first, then the same message.
    raw = ask | {"stream": True, "temperature": 0, "agent_progress": True}
    del raw["extra_body"]
    events = parse_sse(httpx.post(server.url + "/v1/messages", json=raw, timeout=120).text)
    names = [e.name for e in events]
    assert names[:3] == ["agent_tool_call", "agent_tool_result", "message_start"]
    assert names[-1] == "message_stop"
    assert [n["name"] for n in _agent_events(events)] == ["lookup", "lookup"]
    deltas = [e.json()["delta"] for e in events if e.name == "content_block_delta"]
    assert "".join(d.get("text", "") for d in deltas) == text


def test_anthropic_count_tokens_counts_the_server_tools_as_the_prompt_holds_them(
    server: LiveServer, calls_log: Path
) -> None:
    """The server's tools are in a message's prompt; counting its tokens counts them too. A
    reply cut at one token ends the loop in its first round, so its usage is that prompt's."""
    body: dict[str, Any] = {"model": "default", "messages": PERU}
    body |= {"tool_choice": {"type": "tool", "name": "lookup"}, "temperature": 0}
    before = len(_calls(calls_log))
    message = httpx.post(server.url + "/v1/messages", json=body | {"max_tokens": 1}, timeout=120)
    assert message.status_code == 200 and _new_calls(calls_log, before) == []
    counted = httpx.post(server.url + "/v1/messages/count_tokens", json=body, timeout=60)
    assert counted.json()["input_tokens"] == message.json()["usage"]["input_tokens"]
    bare = httpx.post(
        server.url + "/v1/messages/count_tokens", json=body | {"max_tool_rounds": 0}, timeout=60
    )
    assert bare.status_code == 400  # the forced tool is a server tool, not offered with 0
    unforced = {"model": "default", "messages": PERU}
    without = httpx.post(
        server.url + "/v1/messages/count_tokens", json=unforced | {"max_tool_rounds": 0}
    )
    assert without.json()["input_tokens"] < counted.json()["input_tokens"]


def test_the_responses_api_runs_the_loop(
    server: LiveServer, client: openai.OpenAI, calls_log: Path
) -> None:
    """The call the server ran is an ``mcp_call`` item before the answer, in the reply, in
    the stream's events (each checked against OpenAI's spec) and in the stored history a
    follow-up builds on."""
    ask: dict[str, Any] = {
        "model": "default",
        "input": "What is the capital of Peru?",
        "temperature": 0,
        "tool_choice": {"type": "function", "name": "lookup"},
        "max_tool_rounds": 1,
    }
    before = len(_calls(calls_log))
    raw = httpx.post(server.api + "/responses", json=ask, timeout=120).json()
    check_openai("Response", raw)
    response = client.responses.retrieve(raw["id"])
    (call,) = _new_calls(calls_log, before)
    assert call["tool"] == "lookup" and response.status == "completed"
    mcp, answer = response.output
    assert mcp.type == "mcp_call" and answer.type == "message"
    assert (mcp.name, mcp.server_label) == ("lookup", "calc")
    assert json.loads(mcp.arguments) == call["arguments"]
    assert _lookup_answer(call) in (mcp.output or "")
    assert _lookup_answer(call) in response.output_text

    body = httpx.post(server.api + "/responses", json=ask | {"stream": True}, timeout=120).text
    events = [json.loads(e.data) for e in parse_sse(body)]
    for event in events:
        check_responses_event(event)
    kinds = [e["type"] for e in events]
    ended = mcp.status  # failed when the lookup knew no capital
    assert ended in ("completed", "failed")
    assert kinds[:6] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.mcp_call.in_progress",
        f"response.mcp_call.{ended}",
        "response.output_item.done",
    ]
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["mcp_call", "message"]
    assert final["output"][1]["content"][0]["text"] == response.output_text

    follow = client.responses.create(
        model="default",
        previous_response_id=response.id,
        input="Thank you.",
        max_output_tokens=8,
        extra_body={"max_tool_rounds": 0},
    )
    assert follow.status in ("completed", "incomplete")
    assert follow.usage is not None and response.usage is not None
    assert follow.usage.input_tokens > 0


def test_a_clients_own_tool_is_returned_to_it(client: openai.OpenAI, calls_log: Path) -> None:
    before = len(_calls(calls_log))
    reply = _chat(
        client,
        tools=[OWN_TOOL],
        tool_choice={"type": "function", "function": {"name": "local_clock"}},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls or []] == ["local_clock"]
    assert _new_calls(calls_log, before) == []


def test_the_last_round_calls_no_server_tool(client: openai.OpenAI) -> None:
    """With the client's own tool beside the server's, forced into ``required`` calls: after
    the one tool round allowed, the last round may call only the client's tool."""
    ask: dict[str, Any] = {
        "tools": [OWN_TOOL],
        "tool_choice": "required",
        "parallel_tool_calls": False,
    }
    first_round = _chat(client, **ask, max_tokens=1).usage
    reply = _chat(client, **ask, max_tokens=64, extra_body={"max_tool_rounds": 1})
    choice = reply.choices[0]
    called = [c.function.name for c in choice.message.tool_calls or []]
    assert set(called) <= {"local_clock"}, called
    if not called:  # a server tool was called first (required), then the model answered
        assert reply.usage is not None and first_round is not None
        assert reply.usage.prompt_tokens > 2 * first_round.prompt_tokens
        assert choice.finish_reason in ("stop", "length")


def test_zero_rounds_offers_no_server_tool(client: openai.OpenAI) -> None:
    plain = _chat(client, max_tokens=4, extra_body={"max_tool_rounds": 0}).usage
    offered = _chat(client, max_tokens=4).usage
    assert plain is not None and offered is not None
    assert plain.prompt_tokens < 100 < offered.prompt_tokens  # the tools' descriptions


def test_bad_agent_fields_are_400s(server: LiveServer) -> None:
    base = {"messages": PERU, "max_tokens": 4}
    too_many = httpx.post(server.api + "/chat/completions", json=base | {"max_tool_rounds": 4})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "max_tool_rounds"
    clash = {"type": "function", "function": {"name": "lookup", "parameters": {}}}
    named = httpx.post(server.api + "/chat/completions", json=base | {"tools": [clash]})
    assert named.status_code == 400, named.text
    assert "server-side" in named.json()["error"]["message"]
    code = httpx.post(server.api + "/chat/completions", json=base | {"enable_code_execution": True})
    assert code.status_code == 400 and "--enable-code-execution" in code.text
    denied = {"type": "function", "function": {"name": "authorization"}}  # deny: never offered
    forced = httpx.post(server.api + "/chat/completions", json=base | {"tool_choice": denied})
    assert forced.status_code == 400 and forced.json()["error"]["param"] == "tool_choice"
    unstreamed = httpx.post(server.api + "/chat/completions", json=base | {"agent_progress": True})
    assert unstreamed.status_code == 400
    assert unstreamed.json()["error"]["param"] == "agent_progress"
    message = {"model": "default", "max_tokens": 4, "messages": PERU, "agent_progress": True}
    anthropic_unstreamed = httpx.post(server.url + "/v1/messages", json=message)
    assert anthropic_unstreamed.status_code == 400, anthropic_unstreamed.text


# -- approvals ---------------------------------------------------------------------------------


def _answer_first_approval(server: LiveServer, approve: bool, seen: list[dict[str, Any]]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        waiting = httpx.get(server.api + "/agent/approvals").json()["data"]
        if waiting:
            seen.extend(waiting)
            url = f"{server.api}/agent/approvals/{waiting[0]['id']}"
            httpx.post(url, json={"approve": approve}).raise_for_status()
            return
        time.sleep(0.05)


def _multiply(client: openai.OpenAI) -> Any:
    return client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "What is 6 times 7?"}],
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "multiply"}},
        extra_body={"max_tool_rounds": 1},
    )


@pytest.mark.parametrize("approve", [True, False])
def test_an_ask_tool_waits_for_its_approval(
    server: LiveServer, client: openai.OpenAI, calls_log: Path, approve: bool
) -> None:
    seen: list[dict[str, Any]] = []
    answerer = threading.Thread(target=_answer_first_approval, args=(server, approve, seen))
    answerer.start()
    before = len(_calls(calls_log))
    reply = _multiply(client)
    answerer.join()
    assert [(a["tool"], a["arguments"]) for a in seen] == [("multiply", {"a": 6, "b": 7})]
    ran = _new_calls(calls_log, before)
    if approve:
        assert ran == [{"tool": "multiply", "arguments": {"a": 6.0, "b": 7.0}}]
        assert "42" in (reply.choices[0].message.content or "")
    else:
        assert ran == []
    assert reply.choices[0].finish_reason == "stop"


def test_a_stream_that_asks_names_the_approval_to_answer(
    server: LiveServer, calls_log: Path
) -> None:
    """With ``agent_progress`` a call waiting for approval is announced in the stream with
    its approval id; the client answers it from there, and sees the call's result."""
    body = {
        "messages": [{"role": "user", "content": "What is 6 times 7?"}],
        "temperature": 0,
        "tool_choice": {"type": "function", "function": {"name": "multiply"}},
        "max_tool_rounds": 1,
        "stream": True,
        "agent_progress": True,
    }
    before, asked_at = len(_calls(calls_log)), time.time()
    notes: list[dict[str, Any]] = []
    with httpx.stream("POST", server.api + "/chat/completions", json=body, timeout=60) as reply:
        name = None
        for line in reply.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: ") and name is not None:
                notes.append(json.loads(line.removeprefix("data: ")))
                if name == "agent_approval_request":
                    url = f"{server.api}/agent/approvals/{notes[-1]['approval_id']}"
                    httpx.post(url, json={"approve": True}).raise_for_status()
                name = None
    kinds = [n["type"] for n in notes]
    assert kinds == ["agent_tool_call", "agent_approval_request", "agent_tool_result"]
    assert notes[1]["expires_at"] >= asked_at + APPROVAL_TIMEOUT_S - 1  # when it would be denied
    assert notes[0]["call_id"] == notes[1]["call_id"] == notes[2]["call_id"]
    assert "42" in notes[2]["output"] and not notes[2]["is_error"]
    assert _new_calls(calls_log, before) == [
        {"tool": "multiply", "arguments": {"a": 6.0, "b": 7.0}}
    ]


def test_an_unanswered_approval_times_out_as_denied(
    server: LiveServer, client: openai.OpenAI, calls_log: Path
) -> None:
    before = len(_calls(calls_log))
    started = time.monotonic()
    reply = _multiply(client)
    assert time.monotonic() - started >= APPROVAL_TIMEOUT_S
    assert _new_calls(calls_log, before) == []
    assert reply.choices[0].finish_reason == "stop"
    assert httpx.get(server.api + "/agent/approvals").json()["data"] == []


def test_answering_no_waiting_call_is_a_404_and_a_bad_body_a_400(server: LiveServer) -> None:
    missing = httpx.post(server.api + "/agent/approvals/apr_nothing", json={"approve": True})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "approval_not_found"
    bad = httpx.post(server.api + "/agent/approvals/apr_nothing", json={"approve": "yes"})
    assert bad.status_code == 400


# -- hostile tools -----------------------------------------------------------------------------


@pytest.mark.parametrize("tool", ["hang", "crash", "big", "weather"])
def test_a_hostile_tool_becomes_a_result_and_the_request_completes(
    server: LiveServer, client: openai.OpenAI, calls_log: Path, tool: str
) -> None:
    """A tool that hangs (past its 10 s timeout), kills its server, answers 10 MB (bounded to
    4 KiB) or answers text shaped like chat-template control tokens: the request
    ends with the model's answer, and the server's tools work again afterwards."""
    started = time.monotonic()
    reply = _chat(
        client,
        max_tokens=48,
        tool_choice={"type": "function", "function": {"name": tool}},
        extra_body={"max_tool_rounds": 1},
    )
    assert time.monotonic() - started < 60
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert not reply.choices[0].message.tool_calls
    before = len(_calls(calls_log))
    again = _chat(client, tool_choice=LOOKUP, extra_body={"max_tool_rounds": 1})
    (call,) = _new_calls(calls_log, before)
    assert call["tool"] == "lookup"
    assert _lookup_answer(call) in (again.choices[0].message.content or "")


def test_a_session_keeps_the_tool_rounds(server: LiveServer, client: openai.OpenAI) -> None:
    """The loop's calls and results join the session as chat turns, so the next request's
    prompt holds them: its prompt is the stateless request's that sends them itself."""
    session = f"tools-{time.time_ns()}"
    first = _chat(
        client, tool_choice=LOOKUP, extra_body={"max_tool_rounds": 1, "session_id": session}
    )
    kept = httpx.get(f"{server.api}/agent/sessions/{session}").json()["messages"]
    assert [m["role"] for m in kept] == ["user", "assistant", "tool", "assistant"]
    (call,) = kept[1]["tool_calls"]
    assert call["function"]["name"] == "lookup" and kept[2]["tool_call_id"] == call["id"]
    assert kept[3]["content"] == first.choices[0].message.content
    follow = {"role": "user", "content": "Thanks."}
    ask: dict[str, Any] = {"max_tokens": 4, "extra_body": {"max_tool_rounds": 0}}
    inside = _chat(
        client,
        messages=[follow],
        **ask | {"extra_body": ask["extra_body"] | {"session_id": session}},
    )
    outside = _chat(client, messages=[*kept, follow], **ask)
    assert inside.usage is not None and outside.usage is not None
    assert inside.usage.prompt_tokens == outside.usage.prompt_tokens


def test_a_session_shows_the_call_that_waits_for_approval(
    server: LiveServer, client: openai.OpenAI
) -> None:
    """While a session's request waits for an approval, the session shows the waiting call
    (even before it holds a message); answered, the call and the reply join the session."""
    session = f"ask-{time.time_ns()}"
    url = f"{server.api}/agent/sessions/{session}"
    replies: list[Any] = []

    def ask() -> None:
        replies.append(
            client.chat.completions.create(
                model="default",
                messages=[{"role": "user", "content": "What is 6 times 7?"}],
                temperature=0,
                tool_choice={"type": "function", "function": {"name": "multiply"}},
                extra_body={"max_tool_rounds": 1, "session_id": session},
            )
        )

    asking = threading.Thread(target=ask)
    asking.start()
    waiting: list[dict[str, Any]] = []
    deadline = time.monotonic() + 60
    while not waiting and time.monotonic() < deadline:
        shown = httpx.get(url)
        if shown.status_code == 200:
            assert shown.json()["messages"] == []  # kept once the reply is whole
            waiting = shown.json()["pending_approvals"]
        time.sleep(0.05)
    (call,) = waiting
    assert (call["tool"], call["session_id"]) == ("multiply", session)
    answer = httpx.post(f"{server.api}/agent/approvals/{call['id']}", json={"approve": True})
    answer.raise_for_status()
    asking.join()
    kept = httpx.get(url).json()
    assert kept["pending_approvals"] == []
    assert [m["role"] for m in kept["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert "42" in kept["messages"][2]["content"]
    assert kept["messages"][3]["content"] == replies[0].choices[0].message.content


def test_a_client_that_leaves_cancels_the_call_in_flight(server: LiveServer) -> None:
    """A client gone during a call that would hang for the tool's 10 s timeout: the request
    ends within about a second of the disconnect (the call is cancelled, not waited for)."""
    request_id = f"leaves-{time.time_ns()}"
    body = {
        "messages": PERU,
        "tool_choice": {"type": "function", "function": {"name": "hang"}},
        "max_tool_rounds": 1,
        "temperature": 0,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.api + "/chat/completions",
            json=body,
            headers={"x-request-id": request_id},
            timeout=httpx.Timeout(10, read=3),
        )
    deadline = time.monotonic() + 30
    line = ""
    while time.monotonic() < deadline and not line:
        ended = [ln for ln in server.log.read_text().splitlines() if "request_end" in ln]
        line = next((ln for ln in ended if f"request_id={request_id} " in ln), "")
        time.sleep(0.2)
    assert "outcome=client_disconnected" in line, line
    duration_ms = float(line.split("duration_ms=")[1].split()[0])
    assert duration_ms < TOOL_TIMEOUT_S * 1000 - 3000, line  # not the tool's whole timeout
    assert "tool hang: " not in "\n".join(
        ln for ln in server.log.read_text().splitlines() if request_id in ln
    )


def test_a_stream_is_kept_alive_while_a_tool_runs(server: LiveServer) -> None:
    """The rounds run inside a streamed reply: while a call hangs (to its 10 s timeout) the
    client gets keep-alive comments (every 5 s), then the answer and [DONE]."""
    body = {
        "messages": PERU,
        "tool_choice": {"type": "function", "function": {"name": "hang"}},
        "max_tool_rounds": 1,
        "temperature": 0,
        "max_tokens": 64,  # room for the call and a short answer
        "stream": True,
    }
    with httpx.stream("POST", server.api + "/chat/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        lines = [line for line in reply.iter_lines() if line]
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
    assert first_data >= 1 and all(line.startswith(":") for line in lines[:first_data])
    assert lines[-1] == "data: [DONE]"
