"""The server's side of the agent loop: its tools, started once, and each request's loop.

``AgentRuntime`` holds the tool sources the server was given (``--mcp-config``,
``--tool-dispatch-url``, ``--enable-code-execution``, ``--skills-dir``, functions of an
embedding program) in one ``ToolBox``, started on the first request that could use it (in the
serving loop, where the MCP sessions live), and the broker of approvals. Per request,
``server_tools`` gives the server's tools (``ServerTools``: with the request's own MCP servers,
``connect``ed for the Responses ``mcp`` tool) and ``ServerTools.loop`` the loop over them and
the request's tools, parsed together under one tool choice (``ToolLoop``), or None when no
loop runs.

The loop runs for a request when the server has tools, the request asks for one choice, its
``tool_choice`` is not ``none`` and its ``max_tool_rounds`` (at most the server's
``--max-tool-rounds``) is not 0. With code execution on, each request gets its own sandboxed
Python session, started only when the model first calls ``python`` and closed when the loop
ends, so no state passes between requests.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from inferd.agent.config import AgentConfig, AgentConfigError, McpServerConfig
from inferd.agent.mcp_tools import McpTools
from inferd.agent.sandbox import CodeExecutionTools, FileSink, SavedFile
from inferd.agent.search import DirectoryIndex, Embed, SearchBackend, SearchTools, UrlSearch
from inferd.agent.skills import SkillStore
from inferd.agent.toolbox import ToolBox
from inferd.agent.tools import ToolResult, ToolSource, ToolSourceError
from inferd.agent.tools import ToolSpec as ServerTool
from inferd.agent.untrusted import control_pattern
from inferd.agent.url_policy import McpUrlPolicy, OutboundUrlRefused
from inferd.server.approvals import ApprovalBroker
from inferd.server.errors import APIError, bad_request
from inferd.server.openai_tools import ToolRequest
from inferd.serving.served import ServedModel
from inferd.structured.constraint import Constraint, ConstraintError
from inferd.structured.tool_syntax import ToolFormat, ToolSpec

log = logging.getLogger(__name__)

_RESULT_MARKERS = ("<tool_response>", "</tool_response>")  # what wraps a result in the prompt
RETRY_S = 30.0  # how often sources that did not start are tried again


@dataclass(frozen=True, slots=True)
class RanCall:
    """A call the loop ran: what the model asked and what the tool answered."""

    call_id: str
    name: str
    arguments: str  # JSON text, as the model wrote it
    result: ToolResult
    source: str  # the tool source's name (an MCP server's label)
    round: int = 0  # the loop's round that made it, from 0


@dataclass(frozen=True, slots=True)
class ToolLoop:
    """How one request's loop runs: the tools it may call and its bounds."""

    box: ToolBox  # the server's sources, and this request's own code session
    offered: ToolRequest  # the request's tools and the server's, as the model sees them
    fmt: ToolFormat
    max_rounds: int  # tool rounds the server runs, at most
    answer: Any  # the JSON schema of a text answer beside the calls (response_format), or None
    broker: ApprovalBroker
    control: re.Pattern[str] | None  # chat-template control text, broken in tool output
    owned: tuple[ToolSource, ...] = ()  # sources made for this request, closed after it
    # A call needing approval ends the loop (the Responses API: the reply asks, and a next
    # request answers) rather than waiting at /v1/agent/approvals.
    defer_approvals: bool = False
    # The request asked for web search: the server searches for the user's last message
    # before the model's first round (as OpenAI's search models always search), and the
    # model may search again.
    search: SearchTools | None = None

    def runs(self, name: str) -> bool:
        """Whether the server runs calls to ``name`` (else the client does)."""
        return self.box.spec(name) is not None

    @property
    def allowed(self) -> frozenset[str]:
        return frozenset(t.name for t in self.offered.callable)

    def asks(self, name: str) -> bool:
        """Whether a call of ``name`` waits for a person's approval."""
        spec = self.box.spec(name)
        return spec is not None and spec.permission == "ask" and name in self.allowed

    def later_constraint(self) -> Constraint | None:
        """The constraint of the rounds after the first: a forced tool choice holds for the
        first round only (as the openai-agents SDK resets it), so the model can then answer."""
        return replace(self.offered, choice="auto", named=None).constraint(self.fmt, self.answer)

    def final_tools(self) -> ToolRequest | None:
        """What the last round a loop allows may call: the client's own tools (the server
        runs no more), or None when the request has none."""
        own = tuple(t for t in self.offered.tools if not self.runs(t.name))
        if not own:
            return None
        return replace(self.offered, tools=own, choice="auto", named=None)

    def final_constraint(self) -> Constraint | None:
        """The last round's constraint: calls to the client's tools only, or the answer's
        shape (response_format), or nothing."""
        tools = self.final_tools()
        if tools is not None:
            return tools.constraint(self.fmt, self.answer)
        return None if self.answer is None else Constraint.json_schema(self.answer)

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.owned), return_exceptions=True)


@dataclass(frozen=True, slots=True)
class HostedSource:
    """A request's own MCP server, connected, and the tools the request lets the model see."""

    source: McpTools
    allowed: frozenset[str] | None  # None: all of them

    def listed(self) -> list[ServerTool]:
        return [t for t in self.source.tools() if self.allowed is None or t.name in self.allowed]

    def hidden(self) -> list[str]:
        return [t.name for t in self.source.tools() if t not in self.listed()]


@dataclass(frozen=True, slots=True)
class SearchAsk:
    """A request's ask for web search: the field that asked (for errors) and how many hits
    one search shows the model."""

    param: str
    k: int = 5


# search_context_size -> hits per search
CONTEXT_HITS = {"low": 3, "medium": 5, "high": 8}


@dataclass(frozen=True, slots=True)
class ServerTools:
    """The server's tools for one request, before its own are known."""

    box: ToolBox
    specs: tuple[ToolSpec, ...]  # as the model is offered them
    max_rounds: int
    broker: ApprovalBroker
    owned: tuple[ToolSource, ...] = ()
    search: SearchTools | None = None  # the request asked for web search

    @property
    def saved_files(self) -> list[SavedFile]:
        """The files the request's code execution wrote and stored, in order."""
        return [f for s in self.owned if isinstance(s, CodeExecutionTools) for f in s.saved]

    def loop(
        self,
        model: ServedModel,
        tools: ToolRequest | None,
        answer: Any = None,
        *,
        defer_approvals: bool = False,
    ) -> ToolLoop | None:
        """The request's loop over ``tools`` (the request's and the server's, parsed
        together), or None when tool use is off (``tool_choice: none``) or nothing runs here."""
        if self.search is not None and (tools is None or not tools.active):
            raise bad_request(
                "tool_choice: none turns tools off, and the request asks for web search",
                "tool_choice",
            )
        if tools is None or not tools.active:
            return None
        if not any(self.box.spec(t.name) is not None for t in tools.callable):
            return None
        fmt = model.tool_format
        markers = (*fmt.syntax.starts, *_RESULT_MARKERS)
        return ToolLoop(
            self.box,
            tools,
            fmt,
            self.max_rounds,
            answer,
            self.broker,
            control_pattern(model.tokenizer.special_token_pattern, markers),
            self.owned,
            defer_approvals,
            self.search,
        )

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.owned), return_exceptions=True)


def progress_asked(agent_progress: bool | None, stream: bool | None) -> bool:
    """Whether a chat or Anthropic request asks for the loop's progress events: a 400 unless
    it streams (the events are a stream's)."""
    if agent_progress and not stream:
        raise bad_request(
            "agent_progress: the loop's progress comes as events of a stream; send stream: true",
            "agent_progress",
        )
    return bool(agent_progress)


class AgentRuntime:
    def __init__(
        self, config: AgentConfig, extra: Sequence[ToolSource] = (), embed: Embed | None = None
    ) -> None:
        """``embed``: the server's embedding model, for --search-embedding-model."""
        self.config = config
        self.extra = list(extra)
        self.search: SearchBackend | None = None  # web search's backend, if the server has one
        if config.search_dir is not None:
            rerank = embed if config.search_embedding_model is not None else None
            self.search = DirectoryIndex(config.search_dir, rerank)
        elif config.search_url is not None:
            self.search = UrlSearch(config.search_url)
        self.broker = ApprovalBroker(config.approval_timeout_s)
        # /v1/skills's view of --skills-dir (the toolbox reads the same folder)
        self.skills = SkillStore(config.skills_dir) if config.skills_dir is not None else None
        self._box: ToolBox | None = None
        self._lock: asyncio.Lock | None = None
        self._tried = 0.0  # when the sources were last started or retried (time.monotonic)
        self._schemas: dict[str, bool] = {}  # a tool's schema text -> whether it compiles

    @property
    def enabled(self) -> bool:
        return self.config.has_sources or bool(self.extra)

    async def toolbox(self) -> ToolBox:
        """The server's sources, started on first use; sources that failed are tried again,
        at most every ``RETRY_S`` seconds (a server that is down must not cost every request
        a connection attempt)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            now = time.monotonic()
            if self._box is None:
                shared = replace(self.config, code_execution=False)  # per request instead
                box = ToolBox.from_config(shared, self.extra)
                await box.start()
                self._box, self._tried = box, now
            elif self._box.failures and now - self._tried >= RETRY_S:
                self._tried = now
                await self._box.refresh()
            return self._box

    async def close(self) -> None:
        if self._box is not None:
            await self._box.close()
        if self.search is not None:
            await self.search.close()

    async def connect(
        self,
        label: str,
        url: str,
        headers: Mapping[str, str],
        *,
        allowed: frozenset[str] | None,
        never_ask: frozenset[str] | None,
        param: str,
    ) -> HostedSource:
        """A request-named MCP server (the Responses ``mcp`` tool), connected and its tools
        listed: a 400 naming ``param`` when ``--mcp-allow-url`` does not allow the URL or it
        resolves to an address never reached, a 424 when the server cannot be reached."""
        try:
            checked = await McpUrlPolicy(self.config.mcp_allow_urls).check(url)
        except OutboundUrlRefused as exc:
            raise bad_request(str(exc), param, code="mcp_server_url_refused") from None
        try:
            config = McpServerConfig(
                label,
                url=url,
                headers=dict(headers),
                permission="allow" if never_ask is None else "ask",
                tool_permissions=dict.fromkeys(never_ask or (), "allow"),
                addresses=checked.addresses,  # no second lookup: no rebinding
            )
        except AgentConfigError as exc:
            raise bad_request(str(exc), param) from None
        source = McpTools(config, max_output_bytes=self.config.max_output_bytes, permission="ask")
        try:
            await source.start()
        except ToolSourceError as exc:
            await source.close()
            raise APIError(424, str(exc), param, "mcp_server_unavailable") from None
        return HostedSource(source, allowed)

    async def server_tools(
        self,
        max_tool_rounds: int | None,
        *,
        n: int = 1,
        code_execution: bool | None = None,
        hosted: Sequence[HostedSource] = (),
        search: SearchAsk | None = None,
        save_files: FileSink | None = None,
    ) -> ServerTools | None:
        """The tools the server runs for one request, or None when the loop does not run for
        it (see the module docstring); 400s for ``max_tool_rounds`` beyond the server's bound
        and for code execution or web search asked of a server without it. ``hosted``: the
        request's own MCP servers (``connect``), closed with the loop; ``search``: the
        request's ask for web search."""
        limit = self.config.max_tool_rounds
        if max_tool_rounds is not None and not 0 <= max_tool_rounds <= limit:
            raise bad_request(
                f"max_tool_rounds must be 0 to {limit} on this server (--max-tool-rounds)",
                "max_tool_rounds",
            )
        try:
            wants_code = self.config.code_execution_for(code_execution)
        except ValueError as exc:
            raise bad_request(str(exc), "enable_code_execution") from None
        if hosted and max_tool_rounds == 0:
            raise bad_request(
                "max_tool_rounds: 0 runs no tool, and the request names mcp servers",
                "max_tool_rounds",
            )
        searching = self._searching(search, n, max_tool_rounds)
        if not (self.enabled or hosted or searching) or n != 1 or max_tool_rounds == 0:
            return None
        shared = await self.toolbox() if self.enabled else ToolBox()
        owned: tuple[ToolSource, ...] = tuple(h.source for h in hosted)
        if wants_code:
            # the files its code writes are stored for the caller (/v1/files) with save_files
            owned += (CodeExecutionTools(permission=self.config.permission, save_files=save_files),)
        if searching is not None:
            owned += (searching,)
        box = ToolBox([*shared.sources, *owned]) if owned else shared
        hidden = {name for h in hosted for name in h.hidden()}
        listed = [t for t in box.tools() if t.name not in hidden]
        names = [t.name for t in listed]
        clash = next((n for n in names if names.count(n) > 1), None)
        if clash is not None:
            raise bad_request(f"tools: two tool sources offer a tool named {clash!r}", "tools")
        specs = tuple(
            ToolSpec(t.name, t.description, dict(t.input_schema))
            for t in listed
            if t.permission != "deny" and self._usable(t)  # a denied tool is never offered
        )
        rounds = max_tool_rounds if max_tool_rounds is not None else limit
        return ServerTools(box, specs, rounds, self.broker, owned, searching)

    def _searching(
        self, search: SearchAsk | None, n: int, max_tool_rounds: int | None
    ) -> SearchTools | None:
        """The request's web search tool, or None when it asks for none; 400s when this
        server has no backend or the request rules the loop out."""
        if search is None:
            return None
        if self.search is None:
            raise bad_request(
                f"{search.param}: web search is not available on this server (inferd serve "
                "--search-dir or --search-url)",
                search.param,
            )
        if n != 1:
            raise bad_request("n: web search answers with one choice; send n: 1", "n")
        if max_tool_rounds == 0:
            raise bad_request(
                "max_tool_rounds: 0 runs no tool, and the request asks for web search",
                "max_tool_rounds",
            )
        return SearchTools(self.search, search.k)

    def _usable(self, tool: ServerTool) -> bool:
        """Whether the tool's input schema can hold its arguments (a grammar is built from
        it); a tool whose schema cannot is left out, once logged."""
        key = repr(sorted(tool.input_schema.items()))
        if key not in self._schemas:
            try:
                Constraint.json_schema(dict(tool.input_schema), param=tool.name)
                self._schemas[key] = True
            except ConstraintError as exc:
                log.warning("tool %s is not offered: its input schema: %s", tool.name, exc)
                self._schemas[key] = False
        return self._schemas[key]
