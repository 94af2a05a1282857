"""MCP servers as tool sources, against real servers written with the SDK (stdio and HTTP):
discovery, calls, and the hostile cases (a hang, a crash, 10 MB, template-shaped text)."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from inferd.agent.config import AgentConfig, AgentConfigError, McpServerConfig
from inferd.agent.mcp_tools import McpTools
from inferd.agent.toolbox import ToolBox
from inferd.agent.tools import ToolSourceError
from inferd.agent.untrusted import control_pattern, neutralize
from inferd.loading.tokenizer import tokenizer_from_gguf
from tests.agent.conftest import free_port, stdio_server
from tests.loading.test_tokenizer import read_tokenizer_metadata


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def box_of(*servers: McpServerConfig, max_output_bytes: int = 65536) -> ToolBox:
    config = AgentConfig(mcp_servers=servers, max_output_bytes=max_output_bytes)
    return ToolBox.from_config(config, environ={})


async def started(box: ToolBox) -> ToolBox:
    await box.start()
    return box


def test_stdio_server_tools_discovered_with_schemas_prefix_and_permissions() -> None:
    server = stdio_server(prefix="calc_", permission="allow", tool_permissions={"crash": "deny"})

    async def main() -> None:
        box = await started(box_of(server))
        try:
            tools = {t.name: t for t in box.tools()}
            assert {"calc_add", "calc_lookup", "calc_hang", "calc_crash"} <= set(tools)
            add = tools["calc_add"]
            assert add.remote_name == "add" and add.description == "Add two numbers."
            assert add.input_schema["required"] == ["a", "b"]
            assert add.input_schema["properties"]["a"]["type"] == "number"
            assert add.permission == "allow" and tools["calc_crash"].permission == "deny"
            assert box.failures == {}
            assert box.describe()[0].startswith("mcp calc (")
            assert "calc_add [allow]" in box.describe()[0]
        finally:
            await box.close()

    run(main())


def test_calls_answer_and_tool_errors_are_results() -> None:
    async def main() -> None:
        box = await started(box_of(stdio_server()))
        try:
            added = await box.call("add", {"a": 2, "b": 3.5})
            assert (added.content, added.is_error) == ("5.5", False)
            assert added.duration_s > 0
            capital = await box.call("lookup", {"country": "Kenya"})
            assert capital.content == "Nairobi" and not capital.is_error
            missing = await box.call("lookup", {"country": "Atlantis"})
            assert missing.is_error and "no capital known for 'Atlantis'" in missing.content
            bad = await box.call("add", {"a": "two"})  # the server's own validation
            assert bad.is_error
            unknown = await box.call("nope", {})
            assert unknown.is_error and "unknown tool" in unknown.content
        finally:
            await box.close()

    run(main())


def test_only_the_allowed_tools_can_be_called() -> None:
    async def main() -> None:
        box = await started(box_of(stdio_server()))
        try:
            refused = await box.call("multiply", {"a": 2, "b": 3}, allowed={"add", "lookup"})
            assert refused.is_error and "not available in this request" in refused.content
            ok = await box.call("add", {"a": 2, "b": 3}, allowed={"add", "lookup"})
            assert ok.content == "5.0"
        finally:
            await box.close()

    run(main())


def test_a_denied_tool_never_runs() -> None:
    server = stdio_server(permission="allow", tool_permissions={"crash": "deny"})

    async def main() -> None:
        box = await started(box_of(server))
        try:
            denied = await box.call("crash", {})
            assert denied.is_error and denied.content == "the tool 'crash' is denied on this server"
            assert (await box.call("add", {"a": 1, "b": 1})).content == "2.0"
            source = box.sources[0]
            assert isinstance(source, McpTools) and source.discoveries == 1  # never crashed
        finally:
            await box.close()

    run(main())


def test_a_server_that_never_answers_the_handshake_times_out_and_is_stopped(
    tmp_path: Path,
) -> None:
    pid_file = tmp_path / "pid"
    mute = McpServerConfig(
        "mute",
        command=sys.executable,
        args=("-c", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
              "time.sleep(120)"),
        timeout_s=1.0,
    )  # fmt: skip

    async def main() -> list[str]:
        box = await started(box_of(mute))
        try:
            return box.describe()
        finally:
            await box.close()

    lines = run(main())
    assert lines[0].endswith("unavailable: MCP server mute: cannot connect (no answer within 1 s)")
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the mute process was terminated, not left behind


def test_a_hanging_tool_times_out_into_an_error_and_the_server_stays_usable() -> None:
    async def main() -> None:
        box = await started(box_of(stdio_server(timeout_s=1.0)))
        try:
            hung = await box.call("hang", {})
            assert hung.is_error and "did not answer within 1 s" in hung.content
            after = await box.call("add", {"a": 1, "b": 1})
            assert after.content == "2.0" and not after.is_error
        finally:
            await box.close()

    run(main())


def test_a_crashed_server_is_an_error_result_then_reconnected_and_rediscovered() -> None:
    async def main() -> None:
        box = await started(box_of(stdio_server()))
        source = box.sources[0]
        assert isinstance(source, McpTools) and source.discoveries == 1
        try:
            crashed = await box.call("crash", {})
            assert crashed.is_error and "closed the connection" in crashed.content
            again = await box.call("multiply", {"a": 6, "b": 7})
            assert again.content == "42.0" and not again.is_error
            assert source.discoveries == 2  # a new process: its tools listed again
        finally:
            await box.close()

    run(main())


def test_ten_megabytes_of_output_are_bounded_and_marked() -> None:
    async def main() -> None:
        box = await started(box_of(stdio_server(), max_output_bytes=4096))
        try:
            return await box.call("big", {"megabytes": 10})
        finally:
            await box.close()

    result = run(main())
    assert not result.is_error and result.truncated
    kept, note = result.content.split("\n[tool output truncated: ")
    assert kept == "x" * 4096
    assert note == f"4096 of {10 * 1024 * 1024} bytes shown]"


def test_template_shaped_output_cannot_become_control_tokens(smollm2_gguf: Path) -> None:
    async def main() -> str:
        box = await started(box_of(stdio_server()))
        try:
            result = await box.call("weather", {"city": "Oslo"})
            assert not result.is_error
            return result.content
        finally:
            await box.close()

    text = run(main())
    tokenizer = tokenizer_from_gguf(read_tokenizer_metadata(smollm2_gguf))
    special = tokenizer.special_token_ids
    assert special & set(tokenizer.encode(text))  # as the server sent it: control tokens
    pattern = control_pattern(tokenizer.special_token_pattern, ["<tool_call>"])
    safe = neutralize(text, pattern)
    assert not special & set(tokenizer.encode(safe))
    assert "<tool_call>" not in safe
    assert safe.replace("\u2060", "") == text  # the model still reads every character


def test_http_server_discovered_and_the_bearer_token_reaches_it(http_server_url: str) -> None:
    server = McpServerConfig("remote", url=http_server_url, bearer_token_env="TEST_MCP_TOKEN")

    async def main() -> None:
        box = ToolBox.from_config(
            AgentConfig(mcp_servers=(server,)), environ={"TEST_MCP_TOKEN": "s3cret-token"}
        )
        await box.start()
        try:
            assert "lookup" in {t.name for t in box.tools()}
            assert (await box.call("lookup", {"country": "peru"})).content == "Lima"
            seen = await box.call("authorization", {})
            assert seen.content == "Bearer s3cret-token"
        finally:
            await box.close()

    run(main())


def test_an_unset_token_variable_is_a_startup_error(http_server_url: str) -> None:
    server = McpServerConfig("remote", url=http_server_url, bearer_token_env="NO_SUCH_TOKEN")
    with pytest.raises(AgentConfigError, match="NO_SUCH_TOKEN"):
        ToolBox.from_config(AgentConfig(mcp_servers=(server,)), environ={})


def test_the_concurrency_cap_holds_on_the_server_side() -> None:
    async def main() -> tuple[list[Any], str]:
        box = await started(box_of(stdio_server(max_concurrent=2)))
        try:
            results = await box.call_many([("slow", {"seconds": 0.3})] * 6)
            return results, (await box.call("peak", {})).content
        finally:
            await box.close()

    results, peak = run(main())
    assert [r.content for r in results] == ["done"] * 6
    assert peak == "2"


def test_cancelling_the_caller_cancels_the_call_on_the_server() -> None:
    async def main() -> None:
        box = await started(box_of(stdio_server(timeout_s=60)))
        try:
            call = asyncio.create_task(box.call("slow", {"seconds": 60}))
            while (await box.call("running", {})).content != "1":
                await asyncio.sleep(0.02)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            while (await box.call("running", {})).content != "0":
                await asyncio.sleep(0.02)  # the server's handler was cancelled too
        finally:
            await box.close()

    run(main())


def test_a_server_that_does_not_start_is_noted_and_the_others_serve() -> None:
    dead = McpServerConfig("dead", url=f"http://127.0.0.1:{free_port()}/mcp", timeout_s=5)
    missing = McpServerConfig("missing", command="/nonexistent/mcp-server-binary")

    async def main() -> None:
        box = await started(box_of(dead, missing, stdio_server()))
        try:
            assert set(box.failures) == {"dead", "missing"}
            lines = box.describe()
            assert lines[0].startswith("mcp dead (") and ": unavailable: " in lines[0]
            assert ": unavailable: " in lines[1]
            assert (await box.call("add", {"a": 1, "b": 2})).content == "3.0"
        finally:
            await box.close()

    run(main())


def test_two_servers_offering_one_name_are_refused_until_prefixed() -> None:
    async def clash(second: McpServerConfig) -> ToolBox:
        box = box_of(stdio_server("one"), second)
        try:
            await box.start()
            return box
        finally:
            await box.close()

    with pytest.raises(ToolSourceError, match="give one of them a 'prefix'"):
        run(clash(stdio_server("two")))
    box = run(clash(stdio_server("two", prefix="two_")))
    assert {"add", "two_add"} <= {t.name for t in box.tools()}
