"""One MCP server as a tool source, on the official ``mcp`` SDK (a client per server).

The SDK's client lives in anyio task groups that must be entered and left by one task, so a
holder task owns each connection: it connects (launching the command over stdio, or over
streamable HTTP with the bearer token), lists the tools, hands the client over and waits to
be told to let go. Calls run on the caller's task through that client. When a call finds the
connection gone (the server crashed, the HTTP session ended), the holder is released, the
call becomes an error result, and the next call connects again and lists the tools again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from inferd.agent.config import McpServerConfig
from inferd.agent.tools import (
    Permission,
    SpecTable,
    ToolCallError,
    ToolSource,
    ToolSourceError,
    ToolSpec,
)
from inferd.version import __version__

log = logging.getLogger(__name__)

MAX_LIST_PAGES = 100  # a server whose tool listing never ends cannot hang discovery
MAX_DESCRIPTION_CHARS = 4096
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what the OpenAI tools shape accepts
CONNECTION_CLOSED = -32000  # JSON-RPC code the SDK gives pending requests of a lost connection
RELEASE_WAIT_S = 5.0


class McpTools(ToolSource):
    """The tools of one MCP server (``McpServerConfig``)."""

    def __init__(
        self,
        config: McpServerConfig,
        *,
        max_output_bytes: int,
        permission: Permission,
        environ: Mapping[str, str] = os.environ,
    ) -> None:
        super().__init__(config.name, config.limits(max_output_bytes))
        self.config = config
        self._table = SpecTable(
            config.name, config.prefix, config.permission or permission, config.tool_permissions
        )
        self._token = config.bearer_token(environ)  # unset variable: a startup error
        self._client: Any = None
        self._holder: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None
        self._lock: asyncio.Lock | None = None
        self.discoveries = 0  # how many times the tools were listed (startup, reconnects)

    @property
    def kind(self) -> str:
        return "mcp"

    async def start(self) -> None:
        await self._connected()

    async def close(self) -> None:
        if self._lock is None:
            return
        async with self._lock:
            await self._release()

    async def _invoke(self, tool: ToolSpec, arguments: dict[str, Any]) -> tuple[str, bool]:
        from mcp import MCPError
        from pydantic import ValidationError

        try:
            client = await self._connected()
        except ToolSourceError as exc:
            raise ToolCallError(str(exc)) from None
        if tool.name not in self._specs:
            raise ToolCallError(f"the MCP server {self.name} no longer offers {tool.name}")
        try:
            result = await client.call_tool(tool.remote_name, arguments)
        except MCPError as exc:
            if exc.code == CONNECTION_CLOSED:
                await self._lost(client)
                raise ToolCallError(
                    f"the MCP server {self.name} closed the connection during the call"
                ) from None
            raise ToolCallError(f"the MCP server {self.name} refused the call: {exc}") from None
        except ValidationError:
            raise ToolCallError(f"the MCP server {self.name} answered a malformed result") from None
        except (OSError, EOFError) as exc:
            await self._lost(client)
            raise ToolCallError(
                f"the connection to the MCP server {self.name} failed: {exc}"
            ) from None
        except Exception as exc:
            if not _is_broken_stream(exc):
                raise
            await self._lost(client)
            raise ToolCallError(f"the connection to the MCP server {self.name} was lost") from None
        return result_text(result), bool(result.is_error)

    # -- the connection -------------------------------------------------------------------------

    async def _connected(self) -> Any:
        """The live client, connecting (and listing the tools) first if there is none."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            holder = self._holder
            if self._client is not None and holder is not None and not holder.done():
                return self._client
            await self._release()
            ready: asyncio.Future[tuple[Any, list[ToolSpec]]] = (
                asyncio.get_running_loop().create_future()
            )
            stop = asyncio.Event()
            holder = asyncio.create_task(self._hold(ready, stop), name=f"mcp {self.name}")
            try:
                async with asyncio.timeout(self.limits.timeout_s):
                    client, specs = await asyncio.shield(ready)
            except BaseException as exc:
                stop.set()
                holder.cancel()
                await _settle(holder)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                reason = (
                    f"no answer within {self.limits.timeout_s:g} s"
                    if isinstance(exc, TimeoutError)
                    else _describe(exc)
                )
                raise ToolSourceError(
                    f"MCP server {self.name}: cannot connect ({reason})"
                ) from None
            self._client, self._holder, self._stop = client, holder, stop
            self._specs = {spec.name: spec for spec in specs}
            self.discoveries += 1
            return client

    async def _lost(self, client: Any) -> None:
        """Let go of ``client``'s connection (if it is still the current one)."""
        assert self._lock is not None
        async with self._lock:
            if self._client is client:
                await self._release()

    async def _release(self) -> None:
        holder, stop = self._holder, self._stop
        self._client = self._holder = self._stop = None
        if holder is None or stop is None:
            return
        stop.set()
        await _settle(holder)

    async def _hold(
        self, ready: asyncio.Future[tuple[Any, list[ToolSpec]]], stop: asyncio.Event
    ) -> None:
        """Own one connection: open it, list the tools, hand both over, wait for ``stop``."""
        try:
            async with contextlib.AsyncExitStack() as stack:
                client = await stack.enter_async_context(await self._client_for(stack))
                specs = await self._discover(client)
                if not ready.done():
                    ready.set_result((client, specs))
                await stop.wait()
        except asyncio.CancelledError:
            if not ready.done():
                ready.cancel()
            raise
        except Exception as exc:
            if not ready.done():
                ready.set_exception(exc)
            else:  # the connection ended after it was handed over: calls find out themselves
                log.debug("MCP server %s: connection ended: %s", self.name, _describe(exc))

    async def _client_for(self, stack: contextlib.AsyncExitStack) -> Any:
        from mcp import Client, Implementation, StdioServerParameters

        info = Implementation(name="inferd", version=__version__)
        cfg = self.config
        if cfg.command is not None:
            params = StdioServerParameters(
                command=cfg.command, args=list(cfg.args), env=dict(cfg.env) or None, cwd=cfg.cwd
            )
            return Client(params, client_info=info)
        import httpx2
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import (
            MCP_DEFAULT_SSE_READ_TIMEOUT,
            MCP_DEFAULT_TIMEOUT,
            create_mcp_http_client,
        )

        from inferd.agent.pinned import pinned_client

        headers = dict(cfg.headers)
        if self._token is not None:
            headers["Authorization"] = f"Bearer {self._token}"
        assert cfg.url is not None
        if cfg.addresses:  # a request-named server: reached only where its URL was checked
            timeout = httpx2.Timeout(MCP_DEFAULT_TIMEOUT, read=MCP_DEFAULT_SSE_READ_TIMEOUT)
            host = urlsplit(cfg.url).hostname or ""
            client = pinned_client(host, cfg.addresses, headers, timeout)
        else:
            client = create_mcp_http_client(headers=headers)
        http = await stack.enter_async_context(client)
        return Client(streamable_http_client(cfg.url, http_client=http), client_info=info)

    async def _discover(self, client: Any) -> list[ToolSpec]:
        specs: dict[str, ToolSpec] = {}
        cursor: str | None = None
        for _ in range(MAX_LIST_PAGES):
            page = await client.list_tools(cursor=cursor, cache_mode="refresh")
            for tool in page.tools:
                spec = self._table.spec(
                    tool.name, (tool.description or "")[:MAX_DESCRIPTION_CHARS], tool.input_schema
                )
                if not TOOL_NAME.match(spec.name):
                    log.warning("MCP server %s: tool name %r skipped", self.name, spec.name[:80])
                    continue
                specs.setdefault(spec.name, spec)
            cursor = page.next_cursor
            if cursor is None:
                break
        return list(specs.values())


def result_text(result: Any) -> str:
    """A ``CallToolResult`` as the text the model reads: text blocks as they are, other media
    named but not shown, structured content as JSON when there is no block."""
    parts: list[str] = []
    for block in result.content:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind in ("image", "audio"):
            parts.append(f"[{kind} {block.mime_type}, not shown]")
        elif kind == "resource_link":
            parts.append(f"[resource {block.uri}]")
        elif kind == "resource":
            text = getattr(block.resource, "text", None)
            parts.append(text if text is not None else f"[binary resource {block.resource.uri}]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False, default=str))
    return "\n".join(parts)


def _is_broken_stream(exc: BaseException) -> bool:
    import anyio

    broken = (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream)
    if isinstance(exc, BaseExceptionGroup):
        return any(_is_broken_stream(e) for e in exc.exceptions)
    return isinstance(exc, broken)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        return _describe(exc.exceptions[0])
    text = str(exc) or type(exc).__name__
    return text[:300]


async def _settle(task: asyncio.Task[None]) -> None:
    """Wait a little for ``task`` to finish by itself, then cancel it; never raises."""
    done, _ = await asyncio.wait({task}, timeout=RELEASE_WAIT_S)
    if not done:
        task.cancel()
        await asyncio.wait({task}, timeout=RELEASE_WAIT_S)
    if task.done() and not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log it as never retrieved
