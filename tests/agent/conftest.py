"""Real MCP servers (tests/agent/mcp_servers.py, on the SDK's server side) for the agent tests:
a fresh stdio server per toolbox, and one streamable-HTTP server on loopback per module."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from inferd.agent.config import McpServerConfig

SERVER_SCRIPT = Path(__file__).with_name("mcp_servers.py")


def stdio_server(name: str = "calc", **settings: Any) -> McpServerConfig:
    """A config launching the test server over stdio."""
    return McpServerConfig(
        name, command=sys.executable, args=(str(SERVER_SCRIPT), "stdio"), **settings
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, proc: subprocess.Popen[bytes]) -> None:
    """Until the server accepts connections (or dies, which fails the test)."""
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"the MCP test server exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("the MCP test server did not start listening")


@pytest.fixture(scope="module")
def http_server_url() -> Iterator[str]:
    """The test server over streamable HTTP on a loopback port: its /mcp URL."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(SERVER_SCRIPT), "http", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, proc)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(10)
