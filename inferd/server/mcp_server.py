"""inferd's models as MCP tools, for other agents: ``inferd mcp`` (stdio) and
``inferd serve --mcp-route`` (streamable HTTP at /mcp).

A tool call is one request to the server's own HTTP API, run through its app in process
(``forward.run_request``): ``chat`` is a POST /v1/chat/completions, ``complete`` a POST
/v1/completions, ``embed`` a POST /v1/embeddings, ``list_models`` a GET /v1/models. So a call
takes the path an HTTP client's request takes (every check, the pipeline, the engine, the
request timeout, metrics and the access log), and a refusal is the API's own message, handed
back as a tool error (``isError``) rather than a protocol error, so the calling model reads it.
Over /mcp the call carries the caller's API key and Host, so the API lets it in exactly when
it let the caller's request in.

Each tool's arguments are checked against its JSON schema before anything runs: a wrong type or
an unknown argument is a tool error naming it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import mcp.types as types
from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import (
    StreamableHTTPASGIApp,
    StreamableHTTPSessionManager,
)
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from inferd.server.envelope import error_response, header
from inferd.server.forward import ForwardedRequest, ResponseHead, run_request
from inferd.version import __version__

MCP_PATH = "/mcp"
SERVER_NAME = "inferd"
# Headers of the caller's /mcp request that its tool calls carry into the API: the key (so the
# API's AuthMiddleware decides) and the Host (already checked on the way in).
_FORWARDED = (b"authorization", b"x-api-key", b"host")
_SHOWN = 300  # characters of an argument error quoted back

_MODEL = {
    "type": "string",
    "description": "a served model's id (see list_models); default: the server's default model",
}
_SAMPLING: dict[str, Any] = {
    "model": _MODEL,
    "max_tokens": {
        "type": "integer",
        "minimum": 1,
        "description": "the most tokens to generate (default: what the context leaves)",
    },
    "temperature": {
        "type": "number",
        "minimum": 0,
        "maximum": 2,
        "description": "0 is greedy: the same text for the same input (default: 1)",
    },
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "seed": {"type": "integer", "description": "makes sampling reproducible"},
    "stop": {
        "type": "array",
        "items": {"type": "string", "minLength": 1},
        "description": "strings that end the text where they appear (not included)",
    },
}
_MESSAGE = {
    "type": "object",
    "properties": {
        "role": {"enum": ["system", "user", "assistant"]},
        "content": {"type": "string"},
    },
    "required": ["role", "content"],
    "additionalProperties": False,
}

TOOLS = (
    types.Tool(
        name="chat",
        description="Answer a conversation with a served chat model (its chat template). "
        "Give `messages`, or `prompt` for a single user message.",
        input_schema={
            "type": "object",
            "properties": {
                "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
                "prompt": {"type": "string", "description": "one user message"},
                **_SAMPLING,
            },
            "additionalProperties": False,
        },
    ),
    types.Tool(
        name="complete",
        description="Continue a text with a served model, no chat template (text completion).",
        input_schema={
            "type": "object",
            "properties": {"prompt": {"type": "string", "minLength": 1}, **_SAMPLING},
            "required": ["prompt"],
            "additionalProperties": False,
        },
    ),
    types.Tool(
        name="embed",
        description="Embed texts with a served embedding model: one vector per text, in order.",
        input_schema={
            "type": "object",
            "properties": {
                "texts": {"type": "array", "items": {"type": "string"}, "minItems": 1},
                "model": {
                    "type": "string",
                    "description": "a served embedding model's id (default: the first served)",
                },
            },
            "required": ["texts"],
            "additionalProperties": False,
        },
    ),
    types.Tool(
        name="list_models",
        description="The served models: id, kind (chat or embedding), status, context length.",
        input_schema={"type": "object", "properties": {}, "additionalProperties": False},
    ),
)
_VALIDATORS = {tool.name: Draft202012Validator(tool.input_schema) for tool in TOOLS}


class ToolFailure(Exception):
    """A call the tool refuses or the API answered with an error: the message the caller
    reads, as a tool error."""


class LocalAPI:
    """The server's HTTP API, called in process through its ASGI app."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def call(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None,
        headers: tuple[tuple[bytes, bytes], ...],
    ) -> dict[str, Any]:
        """The API's JSON answer; ToolFailure with its error message for any error status."""
        raw = b"" if body is None else json.dumps(body).encode()
        sent = (*headers, (b"content-type", b"application/json")) if body is not None else headers
        request = ForwardedRequest(method, path, headers=sent, body=raw)
        status, chunks = 500, []
        async for part in run_request(self.app, request):
            if isinstance(part, ResponseHead):
                status = part.status
            else:
                chunks.append(part)
        try:
            answer = json.loads(b"".join(chunks) or b"null")
        except ValueError:
            answer = None
        if status >= 400 or not isinstance(answer, dict):
            raise ToolFailure(_error_message(status, answer))
        return answer


def _error_message(status: int, answer: Any) -> str:
    """The message of an OpenAI-style error envelope (or of an Anthropic-style one)."""
    error = answer.get("error") if isinstance(answer, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return str(message) if message else f"the server answered HTTP {status}"


def build_mcp_server(app: ASGIApp) -> Server[Any]:
    """The MCP server whose tools call ``app``'s API (an inferd ``build_app``)."""
    api = LocalAPI(app)

    async def list_tools(
        ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=list(TOOLS))

    async def call_tool(
        ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        run = _RUNS.get(params.name)
        if run is None:
            raise MCPError(code=types.INVALID_PARAMS, message=f"no tool named {params.name!r}")
        arguments = params.arguments or {}
        headers = _forwarded(ctx.request)
        try:
            _check(params.name, arguments)
            text, structured = await run(api, arguments, headers)
        except ToolFailure as exc:
            return types.CallToolResult(content=[types.TextContent(text=str(exc))], is_error=True)
        return types.CallToolResult(
            content=[types.TextContent(text=text)], structured_content=structured
        )

    return Server(
        SERVER_NAME,
        version=__version__,
        instructions="inferd serves local language models: chat, complete, embed, list_models.",
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


def _check(name: str, arguments: Mapping[str, Any]) -> None:
    error = best_match(_VALIDATORS[name].iter_errors(arguments))
    if error is None:
        return
    where = ".".join(str(p) for p in error.absolute_path) or "arguments"
    raise ToolFailure(f"{where}: {error.message}"[:_SHOWN])


def _forwarded(request: Any) -> tuple[tuple[bytes, bytes], ...]:
    """The caller's headers a tool call carries (over /mcp; none over stdio)."""
    if not isinstance(request, Request):
        return ()
    return tuple((k, v) for k, v in request.scope["headers"] if k.lower() in _FORWARDED)


# -- the tools ----------------------------------------------------------------------------------
Result = tuple[str, dict[str, Any]]
Headers = tuple[tuple[bytes, bytes], ...]


def _sampling(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling fields as the API names them (``stream`` off: one JSON answer)."""
    keys = ("model", "max_tokens", "temperature", "top_p", "seed", "stop")
    return {k: arguments[k] for k in keys if k in arguments} | {"stream": False}


async def _chat(api: LocalAPI, arguments: Mapping[str, Any], headers: Headers) -> Result:
    messages, prompt = arguments.get("messages"), arguments.get("prompt")
    if (messages is None) == (prompt is None):
        raise ToolFailure("give messages (a conversation) or prompt (one user message), not both")
    conversation = messages if messages is not None else [{"role": "user", "content": prompt}]
    body = {"messages": conversation} | _sampling(arguments)
    answer = await api.call("POST", "/v1/chat/completions", body, headers)
    choice = answer["choices"][0]
    text = choice["message"].get("content") or ""
    result = {
        "model": answer["model"],
        "text": text,
        "finish_reason": choice["finish_reason"],
        "usage": answer["usage"],
    }
    if reasoning := choice["message"].get("reasoning_content"):
        result["reasoning"] = reasoning
    return text, result


async def _complete(api: LocalAPI, arguments: Mapping[str, Any], headers: Headers) -> Result:
    body = {"prompt": arguments["prompt"]} | _sampling(arguments)
    answer = await api.call("POST", "/v1/completions", body, headers)
    choice = answer["choices"][0]
    result = {
        "model": answer["model"],
        "text": choice["text"],
        "finish_reason": choice["finish_reason"],
        "usage": answer["usage"],
    }
    return choice["text"], result


async def _embed(api: LocalAPI, arguments: Mapping[str, Any], headers: Headers) -> Result:
    model = arguments.get("model")
    if model is None:  # the first embedding model served; none: the API says which exist
        cards = (await api.call("GET", "/v1/models", None, headers))["data"]
        model = next((c["id"] for c in cards if c.get("kind") == "embedding"), None)
    body = {"input": arguments["texts"], "encoding_format": "float"}
    if model is not None:
        body["model"] = model
    answer = await api.call("POST", "/v1/embeddings", body, headers)
    vectors = [item["embedding"] for item in sorted(answer["data"], key=lambda d: d["index"])]
    result = {
        "model": answer["model"],
        "dimensions": len(vectors[0]) if vectors else 0,
        "embeddings": vectors,
        "usage": answer["usage"],
    }
    return json.dumps(result), result


async def _list_models(api: LocalAPI, arguments: Mapping[str, Any], headers: Headers) -> Result:
    cards = (await api.call("GET", "/v1/models", None, headers))["data"]
    keep = ("id", "kind", "status", "max_model_len", "alias_for", "parent", "modalities")
    models = [{k: c[k] for k in keep if k in c} for c in cards]
    result = {"models": models}
    return json.dumps(result), result


_RUNS: dict[str, Callable[[LocalAPI, Mapping[str, Any], Headers], Any]] = {
    "chat": _chat,
    "complete": _complete,
    "embed": _embed,
    "list_models": _list_models,
}


# -- the /mcp route -----------------------------------------------------------------------------
class McpRoute:
    """The streamable HTTP endpoint at /mcp, mounted on the inferd app it calls.

    Stateless and answered in JSON: each POST is whole in itself, so no session outlives a
    request and nothing is kept per client. The app's own middleware checks the Host and the
    API key as on every route; a browser's ``Origin`` must be one ``--allowed-origins`` names
    or the server's own (a page elsewhere has no business driving the tools), else 403."""

    def __init__(self, server: Server[Any], allowed_origins: tuple[str, ...]) -> None:
        # The SDK's own Host and Origin check is off: the app's is the one that applies.
        security = TransportSecuritySettings(enable_dns_rebinding_protection=False)
        self.manager = StreamableHTTPSessionManager(
            app=server, json_response=True, stateless=True, security_settings=security
        )
        self.endpoint = StreamableHTTPASGIApp(self.manager)
        self.allowed_origins = allowed_origins

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Held by the app's lifespan: the SDK's task group the requests run in."""
        async with self.manager.run():
            yield

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        origin = header(scope, b"origin")
        if origin is not None and not self._origin_allowed(origin, header(scope, b"host")):
            message = (
                f"the Origin {origin[:100]!r} may not use {MCP_PATH}: start the server with "
                "--allowed-origins naming it"
            )
            await error_response(scope, 403, message, code="origin_not_allowed")(
                scope, receive, send
            )
            return
        await self.endpoint(scope, receive, send)

    def _origin_allowed(self, origin: str, host: str | None) -> bool:
        if "*" in self.allowed_origins or origin in self.allowed_origins:
            return True
        # the server's own pages: the origin names the Host this request came to (both leave
        # out a default port alike)
        netloc = urlsplit(origin).netloc.lower()
        return bool(netloc) and host is not None and netloc == host.strip().lower()


def mount_mcp(app: Any, allowed_origins: tuple[str, ...]) -> McpRoute:
    """Serve the MCP tools at /mcp on ``app`` (a FastAPI app from ``build_app``), calling
    that same app. The caller enters ``running()`` in the app's lifespan."""
    route = McpRoute(build_mcp_server(app), allowed_origins)
    app.add_route(MCP_PATH, route, methods=["GET", "POST", "DELETE"], include_in_schema=False)
    return route


async def serve_stdio(app: ASGIApp) -> None:
    """Serve the MCP tools over this process's stdin and stdout until stdin closes."""
    from mcp.server.stdio import stdio_server

    server = build_mcp_server(app)
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())
