"""All the server-side tools of one server (or one request), behind one name table.

The agent loop asks the toolbox for the tools to show the model and calls them by name.
``call`` refuses (as an error result, which the model reads) any name outside the request's
``allowed`` set, so tool output that talks the model into calling something else gets
nowhere; a name no source lists goes to the dispatch URL when there is one (it runs the
request's own tools). Names are unique across sources: a clash is a startup error. A tool
denied by its permission is listed (the startup line shows it) but never runs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from inferd.agent.config import AgentConfig
from inferd.agent.dispatch import DispatchTools
from inferd.agent.mcp_tools import McpTools
from inferd.agent.sandbox import CodeExecutionTools
from inferd.agent.skill_tools import SkillTools
from inferd.agent.skills import SkillStore
from inferd.agent.tools import CallLimits, ToolResult, ToolSource, ToolSourceError, ToolSpec

log = logging.getLogger(__name__)


class ToolBox:
    def __init__(self, sources: Iterable[ToolSource] = ()) -> None:
        self.sources = list(sources)
        self.failures: dict[str, str] = {}  # source name -> why it did not start

    @classmethod
    def from_config(
        cls,
        config: AgentConfig,
        extra: Iterable[ToolSource] = (),
        *,
        environ: Mapping[str, str] = os.environ,
    ) -> ToolBox:
        """The sources an AgentConfig names (not started), plus ``extra`` (in-process ones).
        With code execution on, the box holds one sandboxed Python session: the loop makes a
        box (or a CodeExecutionTools) per conversation, so sessions are not shared."""
        sources: list[ToolSource] = [
            McpTools(
                server,
                max_output_bytes=config.max_output_bytes,
                permission=config.permission,
                environ=environ,
            )
            for server in config.mcp_servers
        ]
        if config.code_execution:  # one sandboxed session per toolbox
            sources.append(CodeExecutionTools(permission=config.permission))
        if config.skills_dir is not None:  # read-only: allowed unless tools are denied
            sources.append(
                SkillTools(
                    SkillStore(config.skills_dir),
                    permission="deny" if config.permission == "deny" else "allow",
                    max_output_bytes=config.max_output_bytes,
                )
            )
        sources.extend(extra)
        if config.dispatch_url is not None:
            limits = CallLimits(config.dispatch_timeout_s, max_output_bytes=config.max_output_bytes)
            sources.append(DispatchTools(config.dispatch_url, limits, permission=config.permission))
        return cls(sources)

    async def start(self) -> None:
        """Start every source, side by side. One that fails is noted in ``failures`` (and
        tried again by ``refresh``), not fatal: the others serve. Duplicate tool names across
        the started sources raise ToolSourceError."""
        outcomes = await asyncio.gather(*(s.start() for s in self.sources), return_exceptions=True)
        for source, outcome in zip(self.sources, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, Exception):
                    raise outcome
                self.failures[source.name] = str(outcome) or type(outcome).__name__
                log.warning("tool source %s did not start: %s", source.name, outcome)
            else:
                self.failures.pop(source.name, None)
        self._check_unique()

    async def refresh(self) -> None:
        """Try again the sources that did not start."""
        retry = [s for s in self.sources if s.name in self.failures]
        for source in retry:
            try:
                await source.start()
            except (ToolSourceError, OSError) as exc:
                self.failures[source.name] = str(exc)
            else:
                self.failures.pop(source.name, None)
        self._check_unique()

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.sources), return_exceptions=True)

    def tools(self) -> list[ToolSpec]:
        """Every listed tool (a dispatch URL lists none)."""
        return [spec for source in self.sources for spec in source.tools()]

    def source_of(self, name: str) -> ToolSource | None:
        for source in self.sources:
            if source.owns(name):
                return source
        return next((s for s in self.sources if s.catch_all), None)

    def spec(self, name: str) -> ToolSpec | None:
        """What a call to ``name`` runs as (its permission included), or None."""
        source = self.source_of(name)
        return source.spec_for(name) if source is not None else None

    async def call(
        self,
        name: str,
        arguments: Mapping[str, Any],
        *,
        allowed: Collection[str] | None = None,
        deadline: float | None = None,
    ) -> ToolResult:
        """Call ``name``; a ToolResult whatever happens (only cancellation propagates).
        ``allowed``: the names this request may call (None: any the toolbox has). A tool whose
        permission is ``deny`` never runs; one marked ``ask`` runs here once the loop has its
        approval."""
        if allowed is not None and name not in allowed:
            return ToolResult(f"the tool {name!r} is not available in this request", True)
        source = self.source_of(name)
        spec = source.spec_for(name) if source is not None else None
        if source is None or spec is None:
            return ToolResult(f"unknown tool {name!r}", True)
        if spec.permission == "deny":  # `ask` is the loop's to settle before it calls
            return ToolResult(f"the tool {name!r} is denied on this server", True)
        if not isinstance(arguments, Mapping):
            return ToolResult(f"the arguments of {name} must be a JSON object", True)
        return await source.call(name, arguments, deadline=deadline)

    async def call_many(
        self,
        calls: Iterable[tuple[str, Mapping[str, Any]]],
        *,
        allowed: Collection[str] | None = None,
        timeout_s: float | None = None,
    ) -> list[ToolResult]:
        """Run several calls side by side (each source's cap still holds), results in order."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        return list(
            await asyncio.gather(
                *(self.call(n, a, allowed=allowed, deadline=deadline) for n, a in calls)
            )
        )

    def describe(self) -> list[str]:
        """Startup lines: each source and its tools (or why it did not start)."""
        lines = []
        for source in self.sources:
            where = getattr(getattr(source, "config", None), "describe", lambda: "")()
            label = f"{source.kind} {source.name}" + (f" ({where})" if where else "")
            if source.name in self.failures:
                lines.append(f"{label}: unavailable: {self.failures[source.name]}")
            elif source.catch_all:
                lines.append(f"{label}: {getattr(source, 'url', '')}, the request's own tools")
            else:
                names = ", ".join(f"{s.name} [{s.permission}]" for s in source.tools())
                lines.append(f"{label}: {names or 'no tools'}")
        return lines

    def _check_unique(self) -> None:
        seen: dict[str, str] = {}
        for source in self.sources:
            for spec in source.tools():
                if spec.name in seen:
                    raise ToolSourceError(
                        f"the tool name {spec.name!r} is offered by both {seen[spec.name]} and "
                        f"{source.name}; give one of them a 'prefix' in the MCP config"
                    )
                seen[spec.name] = source.name


async def probe(config: AgentConfig, environ: Mapping[str, str] = os.environ) -> list[str]:
    """Start the configured sources, describe them and close them again (the startup line
    of `inferd serve`, before the server's own loop runs)."""
    box = ToolBox.from_config(config, environ=environ)
    try:
        await box.start()
        return box.describe()
    finally:
        await box.close()
