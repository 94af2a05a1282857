"""Web search in the OpenAI APIs: how a request asks for it, and how the answer cites.

Chat asks with ``web_search_options`` (an object: ``search_context_size`` low | medium | high
sets how many hits one search shows the model, 3, 5 or 8; ``user_location`` is accepted and
not used, the backends have no notion of place); the Responses API with a ``web_search`` (or
``web_search_preview``, or their dated names) tool, whose ``search_context_size`` does the
same. The search itself is the agent loop's ``web_search`` tool (agent/search.py), run first
for the user's last message. The answer's citations (``cite``) come back in each API's own
fields: chat's ``message.annotations`` (``{"type": "url_citation", "url_citation": {...}}``),
the Responses ``output_text.annotations`` (``{"type": "url_citation", ...}``) beside one
``web_search_call`` item per search.
"""

from __future__ import annotations

import json
from typing import Any

from inferd.agent.search import MAX_QUERY_CHARS, TOOL_NAME, Search, SearchTools, cite
from inferd.server.agent_runtime import CONTEXT_HITS, RanCall, SearchAsk
from inferd.server.errors import bad_request

# The Responses tool types that ask for web search.
WEB_SEARCH_TOOLS = frozenset(
    {"web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11"}
)


def search_asked(options: Any) -> SearchAsk | None:
    """Chat's ``web_search_options`` as an ask (None: not given)."""
    if options is None:
        return None
    param = "web_search_options"
    if not isinstance(options, dict):
        raise bad_request(f"{param} must be an object", param)
    unknown = set(options) - {"search_context_size", "user_location"}
    if unknown:
        raise bad_request(f"{param}: unknown field(s) {', '.join(sorted(unknown))}", param)
    return SearchAsk(param, _hits(options.get("search_context_size"), param))


def search_tool(tools: list[Any] | None) -> SearchAsk | None:
    """The Responses request's web search tool as an ask (None: it has none)."""
    found = [
        (i, t)
        for i, t in enumerate(tools or ())
        if isinstance(t, dict) and t.get("type") in WEB_SEARCH_TOOLS
    ]
    if not found:
        return None
    if len(found) > 1:
        raise bad_request("tools: one web_search tool at most", "tools")
    index, tool = found[0]
    where = f"tools.{index}"
    domains = (tool.get("filters") or {}).get("allowed_domains")
    if domains:
        raise bad_request(
            f"{where}.filters.allowed_domains: domain filters are not supported by this server",
            f"{where}.filters",
        )
    return SearchAsk(f"{where}.type", _hits(tool.get("search_context_size"), where))


def _hits(size: Any, where: str) -> int:
    if size is None:
        return CONTEXT_HITS["medium"]
    if size not in CONTEXT_HITS:
        raise bad_request(
            f"{where}.search_context_size must be low, medium or high",
            f"{where}.search_context_size",
        )
    return CONTEXT_HITS[size]


def chat_annotations(search: SearchTools, text: str) -> list[dict[str, Any]]:
    """Chat's ``message.annotations`` for an answer ``text``."""
    return [
        {
            "type": "url_citation",
            "url_citation": {
                "start_index": c.start,
                "end_index": c.end,
                "url": c.url,
                "title": c.title,
            },
        }
        for c in cite(text, search.hits)
    ]


def url_citations(search: SearchTools, text: str) -> list[dict[str, Any]]:
    """The Responses ``output_text.annotations`` for an answer ``text``."""
    return [
        {
            "type": "url_citation",
            "start_index": c.start,
            "end_index": c.end,
            "url": c.url,
            "title": c.title,
        }
        for c in cite(text, search.hits)
    ]


def is_search(call: RanCall) -> bool:
    return call.source == TOOL_NAME


def web_search_call_item(call: RanCall, search: SearchTools, item_id: str) -> dict[str, Any]:
    """A search the loop ran, as the Responses ``web_search_call`` item: its query and the
    sources it found."""
    try:
        query = str(json.loads(call.arguments).get("query", ""))
    except (ValueError, AttributeError):
        query = ""
    ran = query.strip()[:MAX_QUERY_CHARS]  # as the tool ran it
    found: Search | None = next((s for s in search.searches if s.query == ran), None)
    sources = [{"type": "url", "url": h.url} for h in found.hits] if found is not None else []
    return {
        "id": item_id,
        "type": "web_search_call",
        "status": "failed" if call.result.is_error else "completed",
        "action": {"type": "search", "query": query, "queries": [query], "sources": sources},
    }
