"""A request-named MCP server is reached only at the addresses its URL was checked at. The real
test server on loopback is named by a host under the reserved ``.test`` domain, which no DNS
resolves: the URL policy's lookup is made to answer loopback, so the server is reached only if
the connection goes to the checked address without looking the name up again (a second lookup
is what a rebinding DNS answer would exploit). A client pinned to one host refuses another."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest

from inferd.agent import url_policy
from inferd.agent.config import AgentConfig
from inferd.agent.pinned import pinned_client
from inferd.agent.url_policy import UrlPattern
from inferd.server.agent_runtime import AgentRuntime
from tests.agent.conftest import SERVER_SCRIPT, free_port, wait_for_port

HOST = "tools.rebind.test"
LOOPBACK = ipaddress.ip_address("127.0.0.1")


@pytest.fixture(scope="module")
def named_server_port() -> Iterator[int]:
    """The test server over streamable HTTP on loopback, taking requests for ``HOST`` (its
    own rebinding guard checks the Host header)."""
    port = free_port()
    env = os.environ | {"MCP_ALLOWED_HOSTS": f"{HOST}:{port}"}
    proc = subprocess.Popen(
        [sys.executable, str(SERVER_SCRIPT), "http", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, proc)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_connection_goes_to_the_checked_address_without_a_second_lookup(
    named_server_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = named_server_port
    checks: list[str] = []

    async def checked_lookup(host: str, _port: int) -> list[Any]:
        checks.append(host)
        return [LOOPBACK]  # what the policy sees: the address the operator allowed

    monkeypatch.setattr(url_policy, "resolve", checked_lookup)
    config = AgentConfig(mcp_allow_urls=(UrlPattern.parse(f"http://{HOST}:{port}"),))
    runtime = AgentRuntime(config)

    async def connect() -> list[str]:
        hosted = await runtime.connect(
            "calc",
            f"http://{HOST}:{port}/mcp",
            {},
            allowed=None,
            never_ask=None,
            param="tools[0].server_url",
        )
        try:
            names = [t.name for t in hosted.listed()]
            result = await hosted.source.call("lookup", {"country": "Peru"})
            assert result.content == "Lima" and not result.is_error
            return names
        finally:
            await hosted.source.close()

    names = asyncio.run(connect())
    assert "lookup" in names
    assert checks == [HOST]  # looked up once, by the check


def test_a_pinned_client_reaches_no_other_host() -> None:
    async def fetch() -> None:
        timeout = httpx2.Timeout(5.0)
        async with pinned_client(HOST, [LOOPBACK], {}, timeout) as client:
            await client.get("http://elsewhere.test:1/")

    with pytest.raises(httpx2.ConnectError, match=f"may reach {HOST} only"):
        asyncio.run(fetch())
    with pytest.raises(ValueError):
        pinned_client(HOST, [], {}, httpx2.Timeout(5.0))
