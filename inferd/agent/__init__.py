"""The foundation of the server-side agent loop (issue 34): where tools come from and how they
are called safely. The loop itself, and its wiring into the APIs, build on this.

- ``tools``: ToolSpec, ToolResult, the ToolSource interface and the guard around every call
  (timeout, concurrency cap, bounded output; never an exception).
- ``mcp_tools``: an MCP server over stdio or streamable HTTP (the ``mcp`` SDK), reconnecting.
- ``dispatch``: ``--tool-dispatch-url``, each call POSTed as ``{"name", "arguments"}``.
- ``functions``: Python functions registered by an embedding program.
- ``toolbox``: the sources together, routed by name, limited to a request's allowed set.
- ``untrusted``: tool output's chat-template control text broken before the model reads it.
- ``url_policy``: which request-named MCP servers (``server_url``) may be reached.
- ``search``: web search's backends (a local FTS5 index, a search service), its tool, citations.
- ``config``: the ``--mcp-config`` file and the agent flags.

Imports only the base layer (the server imports it); the SDK is imported where it is used.
"""

from inferd.agent.config import AgentConfig, AgentConfigError, McpServerConfig
from inferd.agent.functions import FunctionTools
from inferd.agent.toolbox import ToolBox
from inferd.agent.tools import CallLimits, ToolResult, ToolSource, ToolSourceError, ToolSpec

__all__ = [
    "AgentConfig",
    "AgentConfigError",
    "CallLimits",
    "FunctionTools",
    "McpServerConfig",
    "ToolBox",
    "ToolResult",
    "ToolSource",
    "ToolSourceError",
    "ToolSpec",
]
