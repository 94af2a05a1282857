"""Request models of the OpenAI chat API. Unknown fields are ignored, as OpenAI clients expect.

Parsing goes through ``parse_body`` so every failure becomes a 400 naming the parameter.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from inferd.server.errors import APIError, bad_request

ROLES = ("system", "developer", "user", "assistant", "tool")


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Lenient):
    include_usage: bool = False


class ChatMessage(_Lenient):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
        return role


class SamplingFields(_Lenient):
    """Fields chat and text completions share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    user: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    metadata: dict[str, Any] | None = None
    # Known to OpenAI, not supported here: a request that uses one gets a 400 naming it.
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None


class CompletionRequest(SamplingFields):
    # str | list[str] | list[int] | list[list[int]], checked by the route for clear messages
    prompt: Any = None
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


M = TypeVar("M", bound=BaseModel)


def parse_body(raw: bytes, model: type[M]) -> M:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(
            f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _from_validation(exc) from None


def _from_validation(exc: ValidationError) -> APIError:
    first = exc.errors()[0]
    loc = [str(p) for p in first["loc"] if not str(p).startswith(("function-", "list[", "str"))]
    param = ".".join(loc) or None
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        message = "is required"
    elif first["type"] == "too_short" and param == "messages":
        message = "must contain at least one message"
    return bad_request(f"{param}: {message}" if param else message, param=param)
