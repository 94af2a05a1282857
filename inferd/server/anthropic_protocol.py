"""Request models of Anthropic's Messages API. Unknown fields are ignored.

Content blocks stay plain dicts here; the route checks them one by one so that a block this
server cannot take gets a 400 naming its exact place (``messages.2.content.1``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from inferd.server.protocol import WholeInt, _Lenient


class AnthropicMessage(_Lenient):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class _Prompted(_Lenient):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[Any] | None = None  # checked by server/anthropic_tools.py
    tool_choice: Any = None
    # format: structured output (server/anthropic_output.py); effort is accepted and ignored
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None  # the structured-outputs beta's spelling
    # Known to Anthropic, not supported here: a request that uses one gets a 400 naming it.
    thinking: dict[str, Any] | None = None
    mcp_servers: list[Any] | None = None
    # inferd's agent loop (server/agent_loop.py): 0 rounds runs none of the server's tools
    max_tool_rounds: WholeInt | None = None
    enable_code_execution: bool | None = None


class MessagesRequest(_Prompted):
    max_tokens: WholeInt
    agent_progress: bool | None = None  # the loop's agent_* events in the stream
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: WholeInt | None = None
    metadata: dict[str, Any] | None = None
    stream: bool = False
    service_tier: str | None = None


class CountTokensRequest(_Prompted):
    pass
