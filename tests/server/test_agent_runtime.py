"""The server's agent runtime without a model: sources that did not start are retried at most
every RETRY_S seconds, not on every request."""

from __future__ import annotations

import asyncio

from inferd.agent.config import AgentConfig, McpServerConfig
from inferd.server import agent_runtime
from inferd.server.agent_runtime import AgentRuntime


def test_a_source_that_is_down_is_retried_now_and_then() -> None:
    gone = McpServerConfig("gone", command="/nonexistent/mcp-server")
    runtime = AgentRuntime(AgentConfig(mcp_servers=(gone,), permission="allow"))
    retries: list[int] = []

    async def main() -> None:
        box = await runtime.toolbox()
        assert "gone" in box.failures and box.tools() == []
        real_refresh = box.refresh

        async def counted() -> None:
            retries.append(1)
            await real_refresh()

        box.refresh = counted  # type: ignore[method-assign]
        for _ in range(5):  # requests in quick succession: no new attempt
            assert await runtime.toolbox() is box
        assert retries == []
        runtime._tried -= agent_runtime.RETRY_S  # as if RETRY_S seconds had passed
        await runtime.toolbox()
        assert retries == [1] and "gone" in box.failures
        await runtime.close()

    asyncio.run(main())
