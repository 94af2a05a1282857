"""A dispatch URL (``--tool-dispatch-url``): the request's own tools, run by the operator's
HTTP service.

Each call is one ``POST URL`` with the JSON body ``{"name": ..., "arguments": {...}}``. The
answer is JSON: a string (the tool's text) or an object ``{"content": ...}`` (a string, or
anything else shown as JSON) with an optional ``"is_error": true``. A non-2xx status, a body
that is not such JSON, or one over the size bound, is an error result. The source lists no
tools: it takes a call to any tool the request declared (the toolbox checks that).
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

from inferd.agent.tools import CallLimits, Permission, ToolCallError, ToolSource, ToolSpec
from inferd.version import __version__


def check_dispatch_url(url: str) -> str:
    """``url`` if it is an http(s) URL with a host and no credentials; ValueError says why."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--tool-dispatch-url {url!r} must be an http(s) URL with a host")
    if parts.username is not None or parts.password is not None:
        raise ValueError("--tool-dispatch-url must not carry credentials")
    return url


class DispatchTools(ToolSource):
    """Calls POSTed to one URL."""

    def __init__(self, url: str, limits: CallLimits, *, permission: Permission = "ask") -> None:
        super().__init__("dispatch", limits)
        self.url = check_dispatch_url(url)
        self.permission = permission
        # the raw answer may be larger than the text kept (JSON escapes, a wrapper object),
        # but never unboundedly: past this the answer is refused unread
        self.max_answer_bytes = max(1 << 20, 4 * limits.max_output_bytes)
        self._client: Any = None

    @property
    def kind(self) -> str:
        return "dispatch"

    @property
    def catch_all(self) -> bool:
        return True

    def spec_for(self, name: str) -> ToolSpec | None:
        return ToolSpec(name, "", {}, self.permission, self.name)

    async def start(self) -> None:
        import httpx2  # the HTTP client the mcp SDK brings (pinned with it)

        self._client = httpx2.AsyncClient(
            timeout=httpx2.Timeout(self.limits.timeout_s),
            follow_redirects=False,
            headers={"User-Agent": f"inferd/{__version__} (tool dispatch)"},
        )

    async def _invoke(self, tool: ToolSpec, arguments: dict[str, Any]) -> tuple[str, bool]:
        if self._client is None:
            await self.start()
        body = {"name": tool.name, "arguments": arguments}
        async with self._client.stream("POST", self.url, json=body) as response:
            data = bytearray()
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) > self.max_answer_bytes:
                    raise ToolCallError(
                        f"the tool dispatcher's answer is over {self.max_answer_bytes} bytes"
                    )
            if not 200 <= response.status_code < 300:
                raise ToolCallError(f"the tool dispatcher answered HTTP {response.status_code}")
        return parse_answer(bytes(data))

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def parse_answer(data: bytes) -> tuple[str, bool]:
    """(text, is_error) from a dispatcher's body; ToolCallError when it is not the format."""
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        raise ToolCallError("the tool dispatcher's answer is not JSON") from None
    if isinstance(value, str):
        return value, False
    if isinstance(value, dict) and "content" in value:
        content = value["content"]
        text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
        return text, value.get("is_error") is True
    raise ToolCallError('the tool dispatcher\'s answer is neither a string nor {"content": ...}')
