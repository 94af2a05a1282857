"""Tools that are Python functions of the embedding program (``build_app``/``inferd.LLM``).

    tools = FunctionTools()

    @tools.tool(description="The capital city of a country")
    def capital(country: str) -> str: ...

    tools.register(fetch_rate, schema={"type": "object", "properties": {...}})

A coroutine function runs on the serving loop (a timeout or a client leaving cancels it); a
plain function runs on a worker thread, where a timeout stops the wait but not the thread.
With no ``schema`` one is read off the signature (str, int, float, bool, list, dict and their
optional forms; a parameter with a default is not required). The return value is the tool's
answer: a string as is, anything else as JSON.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from inferd.agent.tools import (
    CallLimits,
    Permission,
    SpecTable,
    ToolCallError,
    ToolSource,
    ToolSpec,
)

_JSON_TYPES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    dict: "object",
}


class FunctionTools(ToolSource):
    """In-process functions as tools."""

    def __init__(
        self,
        name: str = "functions",
        limits: CallLimits | None = None,
        *,
        permission: Permission = "ask",
    ) -> None:
        super().__init__(name, limits or CallLimits())
        self._table = SpecTable(name, default=permission)
        self._functions: dict[str, Callable[..., Any]] = {}

    @property
    def kind(self) -> str:
        return "functions"

    def register(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        schema: Mapping[str, Any] | None = None,
        permission: Permission | None = None,
    ) -> ToolSpec:
        """Expose ``fn`` as a tool; ValueError for a duplicate name or an unreadable signature."""
        tool_name = name or fn.__name__
        if tool_name in self._specs:
            raise ValueError(f"a tool named {tool_name!r} is already registered")
        if schema is None:
            schema = schema_from_signature(fn)
        text = description if description is not None else inspect.getdoc(fn) or ""
        spec = self._table.spec(tool_name, text, schema)
        if permission is not None:
            spec = dataclasses.replace(spec, permission=permission)
        self._specs[tool_name] = spec
        self._functions[tool_name] = fn
        return spec

    def tool(
        self,
        *,
        name: str | None = None,
        description: str | None = None,
        schema: Mapping[str, Any] | None = None,
        permission: Permission | None = None,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """The decorator form of ``register``; the function is returned unchanged."""

        def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
            self.register(
                fn, name=name, description=description, schema=schema, permission=permission
            )
            return fn

        return decorate

    async def start(self) -> None:
        """Nothing to discover: the tools are what was registered."""

    async def _invoke(self, tool: ToolSpec, arguments: dict[str, Any]) -> tuple[str, bool]:
        fn = self._functions[tool.remote_name]
        try:
            inspect.signature(fn).bind(**arguments)
        except TypeError as exc:
            raise ToolCallError(f"bad arguments for {tool.name}: {exc}") from None
        if inspect.iscoroutinefunction(fn):
            value = await fn(**arguments)
        else:
            value = await asyncio.to_thread(fn, **arguments)
        return answer_text(value), False

    async def close(self) -> None:
        """Nothing to release."""


def answer_text(value: Any) -> str:
    """A function's return value as the text the model reads."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


def schema_from_signature(fn: Callable[..., Any]) -> dict[str, Any]:
    """A JSON schema of ``fn``'s keyword-callable parameters, from their annotations."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:  # unresolvable forward references: the caller must give a schema
        raise ValueError(f"cannot read the annotations of {fn.__name__}: {exc}") from None
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise ValueError(f"{fn.__name__}: only named parameters can be tool arguments")
        properties[param.name] = _json_type(hints.get(param.name, Any), fn.__name__, param.name)
        if param.default is param.empty:
            required.append(param.name)
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


def _json_type(hint: Any, fn: str, param: str) -> dict[str, Any]:
    if hint is Any:
        return {}
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(inner) == 1:
            return _json_type(inner[0], fn, param)
    base = origin if origin is not None else hint
    if base in _JSON_TYPES:
        return {"type": _JSON_TYPES[base]}
    raise ValueError(f"{fn}: the type of {param!r} has no JSON schema here; pass schema=")
