"""The one interface every tool source speaks, and the guard around every call.

A ``ToolSource`` lists tools (``ToolSpec``: name, description, JSON input schema, permission)
and calls one. ``ToolSource.call`` is the same for all sources: it waits for a slot under the
source's concurrency cap, runs the source's ``_invoke`` within the call's time limit and bounds
what comes back. Whatever happens (the tool fails, times out, its server crashes or answers
garbage) the caller gets a ``ToolResult``, never an exception: the agent loop shows it to the
model as the tool's answer. Only cancellation of the calling task propagates (a client that
went away cancels its in-flight calls).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

log = logging.getLogger(__name__)

Permission = Literal["allow", "ask", "deny"]
PERMISSIONS: tuple[Permission, ...] = ("allow", "ask", "deny")
DEFAULT_MAX_OUTPUT_BYTES = 64 * 1024
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MAX_CONCURRENT = 4


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A tool as the model sees it (``name``, which may carry the source's prefix) and as its
    source knows it (``remote_name``)."""

    name: str
    description: str
    input_schema: Mapping[str, Any]
    permission: Permission
    source: str  # the source's name, for logs and the startup line
    remote_name: str = ""

    def __post_init__(self) -> None:
        if not self.remote_name:
            object.__setattr__(self, "remote_name", self.name)

    def openai_tool(self) -> dict[str, Any]:
        """The tool in the OpenAI chat ``tools`` shape (what the chat template is given)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.input_schema),
            },
        }


@dataclass(frozen=True, slots=True)
class ToolResult:
    """A call's outcome: the text the model reads, whether it is an error, how long it took."""

    content: str
    is_error: bool = False
    duration_s: float = 0.0
    truncated: bool = False  # the output was cut to the size bound


class ToolCallError(Exception):
    """Raised by a source's ``_invoke`` for a failure whose message the model may read."""


class ToolSourceError(Exception):
    """A source could not start (connect, discover its tools); the message says why."""


def bound_text(text: str, max_bytes: int) -> tuple[str, bool]:
    """``text`` cut to at most ``max_bytes`` UTF-8 bytes (on a character boundary) plus a note
    saying how much was dropped; (text, whether it was cut)."""
    data = text.encode("utf-8", "replace")
    if len(data) <= max_bytes:
        return text, False
    kept = data[:max_bytes].decode("utf-8", "ignore")
    return f"{kept}\n[tool output truncated: {max_bytes} of {len(data)} bytes shown]", True


@dataclass(frozen=True, slots=True)
class CallLimits:
    """How a source's calls are bounded."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    max_concurrent: int = DEFAULT_MAX_CONCURRENT
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES

    def __post_init__(self) -> None:
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ValueError("a tool call timeout must be a positive number of seconds")
        if self.max_concurrent < 1:
            raise ValueError("max_concurrent must be at least 1")
        if self.max_output_bytes < 256:
            raise ValueError("the tool output bound must be at least 256 bytes")


class ToolSource(ABC):
    """Tools from one place (an MCP server, a dispatch URL, in-process functions).

    Subclasses implement ``start`` (discover the tools), ``_invoke`` (one call, raising on
    failure) and ``close``; ``call`` wraps ``_invoke`` in the limits and never raises.
    """

    def __init__(self, name: str, limits: CallLimits) -> None:
        self.name = name
        self.limits = limits
        self._specs: dict[str, ToolSpec] = {}
        self._slots: asyncio.Semaphore | None = None  # made on first use, in the serving loop

    @property
    def kind(self) -> str:
        """What the source is, in a word, for the startup line ("mcp", "dispatch", ...)."""
        return type(self).__name__

    @property
    def catch_all(self) -> bool:
        """Whether the source takes calls to tools it did not list (a dispatch URL runs the
        request's own tools)."""
        return False

    def tools(self) -> list[ToolSpec]:
        """The tools as last discovered."""
        return list(self._specs.values())

    def owns(self, name: str) -> bool:
        return name in self._specs

    @abstractmethod
    async def start(self) -> None:
        """Connect and discover the tools; raises ToolSourceError."""

    @abstractmethod
    async def _invoke(self, tool: ToolSpec, arguments: dict[str, Any]) -> tuple[str, bool]:
        """Run one call: (text, is_error). May raise anything; ``call`` turns it into a result."""

    @abstractmethod
    async def close(self) -> None:
        """Release processes and connections; the source is not used again."""

    def spec_for(self, name: str) -> ToolSpec | None:
        """The spec a call to ``name`` runs under (a catch-all source makes one up)."""
        return self._specs.get(name)

    async def call(
        self, name: str, arguments: Mapping[str, Any], *, deadline: float | None = None
    ) -> ToolResult:
        """Call ``name`` with ``arguments`` by ``deadline`` (time.monotonic(); the source's own
        per-call timeout applies too). Always a ToolResult; only cancellation propagates."""
        started = time.monotonic()
        spec = self.spec_for(name)
        if spec is None:
            return ToolResult(f"unknown tool {name!r}", is_error=True)
        timeout = self.limits.timeout_s
        if deadline is not None:
            timeout = min(timeout, deadline - started)
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limits.max_concurrent)
        try:
            if timeout <= 0:
                raise TimeoutError
            async with asyncio.timeout(timeout):
                # the wait for a slot counts against the call's time: a saturated source
                # times out like a slow one
                async with self._slots:
                    text, is_error = await self._invoke(spec, dict(arguments))
        except TimeoutError:
            text, is_error = f"the tool {name} did not answer within {timeout:.3g} s", True
        except ToolCallError as exc:
            text, is_error = str(exc) or f"the tool {name} failed", True
        except Exception as exc:  # a tool's failure is the model's to read, never a 500
            log.warning("tool %s (%s) failed: %s: %s", name, self.name, type(exc).__name__, exc)
            text, is_error = f"the tool {name} failed: {type(exc).__name__}", True
        text, truncated = bound_text(text, self.limits.max_output_bytes)
        return ToolResult(text, is_error, time.monotonic() - started, truncated)


@dataclass(slots=True)
class SpecTable:
    """Builds a source's ToolSpecs: prefixes names and resolves permissions."""

    source: str
    prefix: str = ""
    default: Permission = "ask"
    per_tool: Mapping[str, Permission] = field(default_factory=dict)

    def spec(self, remote_name: str, description: str, schema: Mapping[str, Any]) -> ToolSpec:
        return ToolSpec(
            name=self.prefix + remote_name,
            description=description,
            input_schema=schema or {"type": "object", "properties": {}},
            permission=self.per_tool.get(remote_name, self.default),
            source=self.source,
            remote_name=remote_name,
        )
