"""The agent flags of `inferd serve` and the --mcp-config file: parsed, checked, and a bad
setting a clear startup error naming the problem; the startup line lists the tools."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from inferd.agent.config import AgentConfigError, load_mcp_config
from inferd.cli import _parser, _probe_tools, main
from inferd.server.serve_args import describe, server_options
from tests.agent.conftest import SERVER_SCRIPT


def options_for(*flags: str) -> Any:
    return server_options(_parser().parse_args(["serve", *flags]), {})


def write(tmp_path: Path, content: Any) -> str:
    path = tmp_path / "mcp.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def test_the_defaults_configure_no_tools_and_ask_before_running_one() -> None:
    agent = options_for().agent
    assert (agent.mcp_servers, agent.dispatch_url, agent.mcp_allow_urls) == ((), None, ())
    assert (agent.max_tool_rounds, agent.permission) == (8, "ask")
    assert not agent.has_sources
    assert not any(line.startswith("agent") for line in describe(options_for()))


def test_flags_and_the_config_file_reach_the_agent_config(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        {
            "mcpServers": {
                "calc": {"command": "python3", "args": ["calc.py"], "env": {"DIGITS": "6"}},
                "search": {
                    "url": "https://search.internal/mcp",
                    "bearer_token_env": "SEARCH_TOKEN",
                    "prefix": "search_",
                    "timeout_s": 12.5,
                    "max_concurrent": 2,
                    "permission": "allow",
                    "tools": {"drop_index": {"permission": "deny"}},
                },
            },
            "max_output_bytes": 10000,
        },
    )
    options = options_for(
        "--mcp-config", path,
        "--tool-dispatch-url", "http://127.0.0.1:7000/run",
        "--max-tool-rounds", "3",
        "--agent-permission", "deny",
        "--mcp-allow-url", "https://*.tools.example.com/mcp",
    )  # fmt: skip
    agent = options.agent
    calc, search = agent.mcp_servers
    assert (calc.name, calc.command, calc.args, dict(calc.env)) == (
        "calc", "python3", ("calc.py",), {"DIGITS": "6"}
    )  # fmt: skip
    assert (search.url, search.bearer_token_env, search.prefix) == (
        "https://search.internal/mcp", "SEARCH_TOKEN", "search_"
    )  # fmt: skip
    assert (search.timeout_s, search.max_concurrent, search.permission) == (12.5, 2, "allow")
    assert dict(search.tool_permissions) == {"drop_index": "deny"}
    assert agent.max_output_bytes == 10000 and agent.max_tool_rounds == 3
    assert agent.dispatch_url == "http://127.0.0.1:7000/run" and agent.permission == "deny"
    assert str(agent.mcp_allow_urls[0]) == "https://*.tools.example.com:443/mcp"
    line = next(line for line in describe(options) if line.startswith("agent"))
    assert line == (
        "agent      2 MCP server(s), a dispatch URL; permission deny; at most 3 tool rounds; "
        "request-named MCP servers 1 pattern(s)"
    )


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("{not json", "not valid JSON"),
        ([], "must hold a JSON object"),
        ({"servers": {}}, "unknown key(s) servers"),
        ({"mcpServers": {"a": {}}}, "MCP server 'a': give either 'command' (stdio) or 'url'"),
        ({"mcpServers": {"a": {"command": "x", "url": "http://h/"}}}, "give either"),
        ({"mcpServers": {"a": {"command": "x", "timeout": 5}}}, "unknown key(s) timeout"),
        ({"mcpServers": {"a": {"command": "x", "timeout_s": 0}}}, "'timeout_s' must be"),
        ({"mcpServers": {"a": {"command": "x", "max_concurrent": 0}}}, "'max_concurrent'"),
        ({"mcpServers": {"a": {"command": "x", "permission": "yes"}}}, "allow, ask or deny"),
        ({"mcpServers": {"a": {"command": "x", "args": "-v"}}}, "'args' must be a list"),
        ({"mcpServers": {"a": {"command": "x", "bearer_token_env": "T"}}}, "go with 'url'"),
        ({"mcpServers": {"a": {"url": "ftp://h/"}}}, "'url' must be http(s)"),
        ({"mcpServers": {"a b": {"command": "x"}}}, "a name is 1-64 letters"),
        ({"mcpServers": {"a": {"command": "x", "prefix": "a.b"}}}, "'prefix' is up to 32"),
        ({"mcpServers": {"a": {"command": "x", "tools": {"t": {"permision": "ask"}}}}}, "tools.t"),
        ({"max_output_bytes": 10}, "'max_output_bytes' must be"),
    ],
)
def test_a_bad_config_file_is_an_error_naming_the_file_and_the_problem(
    tmp_path: Path, content: Any, problem: str
) -> None:
    path = write(tmp_path, content)
    with pytest.raises(AgentConfigError) as err:
        load_mcp_config(path)
    assert str(err.value).startswith(f"--mcp-config {path}: ")
    assert problem in str(err.value)


def test_a_missing_config_file_stops_inferd_serve_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.json"
    assert main(["serve", "--mcp-config", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"inferd: error: --mcp-config {missing}: cannot read it")


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        (["--max-tool-rounds", "0"], "--max-tool-rounds must be 1 to 256"),
        (["--mcp-allow-url", "ftp://x"], "--mcp-allow-url: 'ftp://x'"),
        (["--tool-dispatch-url", "file:///x"], "--tool-dispatch-url 'file:///x' must be"),
    ],
)
def test_bad_agent_flags_are_startup_errors(
    flags: list[str], problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", *flags]) == 2
    assert problem in capsys.readouterr().err


def test_the_startup_line_lists_each_source_and_its_tools(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        {
            "mcpServers": {
                "calc": {
                    "command": sys.executable,
                    "args": [str(SERVER_SCRIPT), "stdio"],
                    "prefix": "calc_",
                    "permission": "allow",
                    "tools": {"crash": {"permission": "deny"}},
                }
            }
        },
    )
    lines = _probe_tools(options_for("--mcp-config", path, "--tool-dispatch-url", "http://h/"))
    assert lines[0].startswith(f"tools      mcp calc ({sys.executable} {SERVER_SCRIPT} stdio): ")
    assert "calc_add [allow], calc_multiply [allow], calc_lookup [allow]" in lines[0]
    assert "calc_crash [deny]" in lines[0]
    assert lines[1] == "tools      dispatch dispatch: http://h/, the request's own tools"


def test_two_servers_with_one_tool_name_stop_the_startup(tmp_path: Path) -> None:
    server = {"command": sys.executable, "args": [str(SERVER_SCRIPT), "stdio"]}
    path = write(tmp_path, {"mcpServers": {"one": server, "two": server}})
    with pytest.raises(ValueError, match="offered by both one and two"):
        _probe_tools(options_for("--mcp-config", path))


def test_code_execution_is_off_by_default_and_the_flag_turns_it_on() -> None:
    off = options_for().agent
    assert off.code_execution is False and not _probe_tools(options_for())
    assert off.code_execution_for(None) is False and off.code_execution_for(False) is False
    with pytest.raises(ValueError, match="code execution is off on this server"):
        off.code_execution_for(True)  # a request cannot turn it on
    options = options_for("--enable-code-execution", "--agent-permission", "allow")
    on = options.agent
    assert on.code_execution and on.has_sources
    assert (on.code_execution_for(None), on.code_execution_for(False)) == (True, False)
    line = next(line for line in describe(options) if line.startswith("agent"))
    assert line.startswith("agent      0 MCP server(s), sandboxed code execution; permission allow")
    # the startup line shows the tool, the sandbox checked (bwrap, libseccomp, the interpreter)
    assert _probe_tools(options) == ["tools      code execution code_execution: python [allow]"]
