"""The agent's settings: the ``--mcp-config`` file and the agent flags of ``inferd serve``.

The MCP config file is JSON:

    {
      "mcpServers": {
        "calc": {"command": "python", "args": ["calc_server.py"], "env": {"PRECISION": "6"},
                 "permission": "allow"},
        "search": {"url": "https://search.internal/mcp", "bearer_token_env": "SEARCH_TOKEN",
                   "prefix": "search_", "timeout_s": 20, "max_concurrent": 2,
                   "tools": {"delete_index": {"permission": "deny"}}}
      },
      "max_output_bytes": 65536
    }

Each server is either launched (``command``, ``args``, ``env``, ``cwd``) and spoken to over
stdio, or reached at ``url`` over streamable HTTP (``headers``; ``bearer_token_env`` names an
environment variable whose value is sent as ``Authorization: Bearer ...``; the token itself is
never written in the file). ``prefix`` goes before each of the server's tool names, as the
model sees them; ``timeout_s`` bounds one call, ``max_concurrent`` the calls running at once;
``permission`` (allow | ask | deny) overrides ``--agent-permission`` for the server, and
``tools.NAME.permission`` for one tool. Unknown keys are errors, so a typo cannot silently
drop a limit.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from inferd.agent.dispatch import check_dispatch_url
from inferd.agent.tools import (
    DEFAULT_MAX_CONCURRENT,
    DEFAULT_MAX_OUTPUT_BYTES,
    DEFAULT_TIMEOUT_S,
    PERMISSIONS,
    CallLimits,
    Permission,
)
from inferd.agent.url_policy import UrlPattern
from inferd.net import IPAddress

DEFAULT_MAX_TOOL_ROUNDS = 8
DEFAULT_APPROVAL_TIMEOUT_S = 120.0
# `ask`: a tool call is an action picked by a model that reads untrusted text (user input,
# earlier tool output), so by default a person approves each one; an operator marks read-only
# tools `allow` in the config file, or passes --agent-permission allow.
DEFAULT_PERMISSION: Permission = "ask"
MAX_TOOL_ROUNDS_LIMIT = 256
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_SERVER_KEYS = frozenset(
    {
        "command",
        "args",
        "env",
        "cwd",
        "url",
        "headers",
        "bearer_token_env",
        "prefix",
        "timeout_s",
        "max_concurrent",
        "permission",
        "tools",
    }
)


class AgentConfigError(ValueError):
    """A bad agent setting; the message names the file, server and key."""


@dataclass(frozen=True, slots=True)
class McpServerConfig:
    """One MCP server: launched over stdio (``command``) or reached over HTTP (``url``)."""

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    bearer_token_env: str | None = None
    prefix: str = ""
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_concurrent: int = DEFAULT_MAX_CONCURRENT
    permission: Permission | None = None  # None: --agent-permission
    tool_permissions: Mapping[str, Permission] = field(default_factory=dict)
    # A request-named server: the addresses its URL's host was checked at, the only ones it is
    # reached at (agent/pinned.py). Empty: the host is resolved as usual (the operator's).
    addresses: tuple[IPAddress, ...] = ()

    def __post_init__(self) -> None:
        where = f"MCP server {self.name!r}"
        if not _NAME.match(self.name):
            raise AgentConfigError(f"{where}: a name is 1-64 letters, digits, '_' or '-'")
        if (self.command is None) == (self.url is None):
            raise AgentConfigError(f"{where}: give either 'command' (stdio) or 'url' (HTTP)")
        if self.url is not None:
            if not self.url.startswith(("http://", "https://")):
                raise AgentConfigError(f"{where}: 'url' must be http(s)://...")
            if self.args or self.env or self.cwd is not None:
                raise AgentConfigError(f"{where}: 'args', 'env' and 'cwd' go with 'command'")
        elif self.headers or self.bearer_token_env is not None:
            raise AgentConfigError(f"{where}: 'headers' and 'bearer_token_env' go with 'url'")
        if self.prefix and not re.fullmatch(r"[A-Za-z0-9_-]{1,32}", self.prefix):
            raise AgentConfigError(f"{where}: 'prefix' is up to 32 letters, digits, '_' or '-'")
        try:
            self.limits(DEFAULT_MAX_OUTPUT_BYTES)
        except ValueError as exc:
            raise AgentConfigError(f"{where}: {exc}") from None

    def limits(self, max_output_bytes: int) -> CallLimits:
        return CallLimits(self.timeout_s, self.max_concurrent, max_output_bytes)

    def bearer_token(self, environ: Mapping[str, str]) -> str | None:
        """The token named by ``bearer_token_env``; AgentConfigError when it is unset."""
        if self.bearer_token_env is None:
            return None
        token = environ.get(self.bearer_token_env, "")
        if not token:
            raise AgentConfigError(
                f"MCP server {self.name!r}: the environment variable "
                f"{self.bearer_token_env} (bearer_token_env) is not set"
            )
        return token

    def describe(self) -> str:
        if self.url is not None:
            return self.url
        return " ".join([cast(str, self.command), *self.args])


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """Where server-side tools come from and how the agent loop is bounded."""

    mcp_servers: tuple[McpServerConfig, ...] = ()
    dispatch_url: str | None = None
    max_tool_rounds: int = DEFAULT_MAX_TOOL_ROUNDS
    permission: Permission = DEFAULT_PERMISSION
    mcp_allow_urls: tuple[UrlPattern, ...] = ()  # request-named MCP servers (Responses `mcp`)
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES
    dispatch_timeout_s: float = DEFAULT_TIMEOUT_S
    config_file: str | None = None  # where mcp_servers came from, for messages
    # the sandboxed `python` tool (agent/sandbox.py); off unless --enable-code-execution
    code_execution: bool = False
    approval_timeout_s: float = DEFAULT_APPROVAL_TIMEOUT_S  # then a waiting call is denied
    # the skills the loop offers (agent/skills.py) and /v1/skills manages; off unless given
    skills_dir: str | None = None
    # web search (agent/search.py): the local index's directory or a search service's URL,
    # and the served embedding model that reranks the local index's hits
    search_dir: str | None = None
    search_url: str | None = None
    search_embedding_model: str | None = None

    def __post_init__(self) -> None:
        if self.permission not in PERMISSIONS:
            raise AgentConfigError("--agent-permission must be allow, ask or deny")
        if not 1 <= self.max_tool_rounds <= MAX_TOOL_ROUNDS_LIMIT:
            raise AgentConfigError(f"--max-tool-rounds must be 1 to {MAX_TOOL_ROUNDS_LIMIT}")
        if not (0 < self.approval_timeout_s <= 86400):
            raise AgentConfigError("--agent-approval-timeout must be over 0 and at most 86400 s")
        if self.dispatch_url is not None:
            try:
                check_dispatch_url(self.dispatch_url)
            except ValueError as exc:
                raise AgentConfigError(str(exc)) from None
        try:
            CallLimits(self.dispatch_timeout_s, DEFAULT_MAX_CONCURRENT, self.max_output_bytes)
        except ValueError as exc:
            raise AgentConfigError(f"{self.config_file or 'agent config'}: {exc}") from None
        names = [s.name for s in self.mcp_servers]
        if len(set(names)) != len(names):
            raise AgentConfigError("two MCP servers have the same name")
        self._check_search()

    def _check_search(self) -> None:
        if self.search_dir is not None and self.search_url is not None:
            raise AgentConfigError("give --search-dir or --search-url, not both")
        if self.search_dir is not None and not Path(self.search_dir).is_dir():
            raise AgentConfigError(f"--search-dir {self.search_dir}: not a directory")
        if self.search_url is not None:
            try:
                UrlPattern.parse(self.search_url)
            except ValueError as exc:
                raise AgentConfigError(f"--search-url: {exc}") from None
        if self.search_embedding_model is not None and self.search_dir is None:
            raise AgentConfigError("--search-embedding-model reranks --search-dir's index")

    @property
    def has_search(self) -> bool:
        """Whether requests may ask for web search."""
        return self.search_dir is not None or self.search_url is not None

    @property
    def has_sources(self) -> bool:
        """Whether any server-side tool source is configured."""
        return (
            bool(self.mcp_servers)
            or self.dispatch_url is not None
            or self.code_execution
            or self.skills_dir is not None
        )

    def code_execution_for(self, requested: bool | None) -> bool:
        """Whether a request's agent loop offers the ``python`` tool, given the request's
        ``enable_code_execution`` (None: not given). The server's flag is the gate: a request
        may turn it off, never on; asking for it where it is off is a ValueError (the
        loop's 400) rather than a silent answer without it."""
        if requested and not self.code_execution:
            raise ValueError(
                "enable_code_execution: code execution is off on this server "
                "(inferd serve --enable-code-execution)"
            )
        return self.code_execution if requested is None else bool(requested)


def load_mcp_config(path: str | os.PathLike[str]) -> tuple[tuple[McpServerConfig, ...], int]:
    """The servers of an MCP config file and its output bound; AgentConfigError says what
    is wrong, naming the file."""
    where = str(path)
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise AgentConfigError(f"--mcp-config {where}: cannot read it ({exc.strerror})") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise AgentConfigError(f"--mcp-config {where}: not valid JSON ({exc})") from None
    try:
        return parse_mcp_config(raw)
    except AgentConfigError as exc:
        raise AgentConfigError(f"--mcp-config {where}: {exc}") from None


def parse_mcp_config(raw: Any) -> tuple[tuple[McpServerConfig, ...], int]:
    """The parsed form of the file's JSON (see the module docstring)."""
    if not isinstance(raw, dict):
        raise AgentConfigError("the file must hold a JSON object")
    unknown = set(raw) - {"mcpServers", "max_output_bytes"}
    if unknown:
        raise AgentConfigError(f"unknown key(s) {', '.join(sorted(unknown))}")
    servers = raw.get("mcpServers", {})
    if not isinstance(servers, dict):
        raise AgentConfigError("'mcpServers' must be an object of name -> server")
    max_output = raw.get("max_output_bytes", DEFAULT_MAX_OUTPUT_BYTES)
    if not isinstance(max_output, int) or isinstance(max_output, bool) or max_output < 256:
        raise AgentConfigError("'max_output_bytes' must be an integer of at least 256")
    return tuple(_server(name, entry) for name, entry in servers.items()), max_output


def _server(name: str, entry: Any) -> McpServerConfig:
    where = f"MCP server {name!r}"
    if not isinstance(entry, dict):
        raise AgentConfigError(f"{where}: must be an object")
    unknown = set(entry) - _SERVER_KEYS
    if unknown:
        raise AgentConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    tools = _mapping(entry, "tools", where, dict)
    per_tool: dict[str, Permission] = {}
    for tool, settings in tools.items():
        if not isinstance(settings, dict) or set(settings) - {"permission"}:
            raise AgentConfigError(f"{where}: tools.{tool} takes only 'permission'")
        if "permission" in settings:
            per_tool[tool] = _permission(settings["permission"], f"{where}: tools.{tool}")
    timeout = entry.get("timeout_s", DEFAULT_TIMEOUT_S)
    if not _is_number(timeout) or not (timeout > 0 and math.isfinite(timeout)):
        raise AgentConfigError(f"{where}: 'timeout_s' must be a positive number")
    concurrent = entry.get("max_concurrent", DEFAULT_MAX_CONCURRENT)
    if not isinstance(concurrent, int) or isinstance(concurrent, bool) or concurrent < 1:
        raise AgentConfigError(f"{where}: 'max_concurrent' must be an integer of at least 1")
    permission = entry.get("permission")
    return McpServerConfig(
        name=name,
        command=_optional_str(entry, "command", where),
        args=tuple(_strings(entry, "args", where)),
        env=_mapping(entry, "env", where, str),
        cwd=_optional_str(entry, "cwd", where),
        url=_optional_str(entry, "url", where),
        headers=_mapping(entry, "headers", where, str),
        bearer_token_env=_optional_str(entry, "bearer_token_env", where),
        prefix=_optional_str(entry, "prefix", where) or "",
        timeout_s=float(timeout),
        max_concurrent=concurrent,
        permission=None if permission is None else _permission(permission, where),
        tool_permissions=per_tool,
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _permission(value: Any, where: str) -> Permission:
    if value not in PERMISSIONS:
        raise AgentConfigError(f"{where}: 'permission' must be allow, ask or deny")
    return cast(Permission, value)


def _optional_str(entry: dict[str, Any], key: str, where: str) -> str | None:
    value = entry.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise AgentConfigError(f"{where}: {key!r} must be a non-empty string")
    return value


def _strings(entry: dict[str, Any], key: str, where: str) -> list[str]:
    value = entry.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise AgentConfigError(f"{where}: {key!r} must be a list of strings")
    return value


def _mapping(entry: dict[str, Any], key: str, where: str, kind: type) -> dict[str, Any]:
    value = entry.get(key, {})
    if not isinstance(value, dict) or not all(isinstance(v, kind) for v in value.values()):
        what = "strings" if kind is str else "objects"
        raise AgentConfigError(f"{where}: {key!r} must be an object of {what}")
    return value


def agent_config(
    *,
    mcp_config: str | None,
    dispatch_url: str | None,
    max_tool_rounds: int,
    permission: str,
    mcp_allow_urls: list[str] | tuple[str, ...],
    code_execution: bool = False,
    approval_timeout_s: float = DEFAULT_APPROVAL_TIMEOUT_S,
    skills_dir: str | None = None,
    search_dir: str | None = None,
    search_url: str | None = None,
    search_embedding_model: str | None = None,
) -> AgentConfig:
    """The AgentConfig of `inferd serve`'s agent flags (the config file read and checked)."""
    servers: tuple[McpServerConfig, ...] = ()
    max_output = DEFAULT_MAX_OUTPUT_BYTES
    if mcp_config is not None:
        servers, max_output = load_mcp_config(mcp_config)
    try:
        patterns = tuple(UrlPattern.parse(p) for p in mcp_allow_urls)
    except ValueError as exc:
        raise AgentConfigError(f"--mcp-allow-url: {exc}") from None
    if skills_dir is not None:
        skills_dir = os.path.abspath(skills_dir)
        if not os.path.isdir(skills_dir):
            raise AgentConfigError(f"--skills-dir {skills_dir}: not a directory")
    return AgentConfig(
        mcp_servers=servers,
        dispatch_url=dispatch_url,
        max_tool_rounds=max_tool_rounds,
        permission=cast(Permission, permission),
        mcp_allow_urls=patterns,
        max_output_bytes=max_output,
        config_file=mcp_config,
        code_execution=code_execution,
        approval_timeout_s=approval_timeout_s,
        skills_dir=skills_dir,
        search_dir=search_dir,
        search_url=search_url,
        search_embedding_model=search_embedding_model,
    )
