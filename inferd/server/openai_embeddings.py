"""POST /v1/embeddings: a string, a list of strings, token ids or a list of token-id lists ->
one vector per input, as float lists or base64 (little-endian float32, as OpenAI sends them).

Token-id inputs go to the model as given (include the model's special tokens yourself, as
/tokenize would). Every input must fit the model's positions; the 400 says by how much not.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from inferd.server.errors import APIError, bad_request
from inferd.server.metrics import request_timer
from inferd.server.protocol import WholeInt, parse_body
from inferd.server.state import ServerState
from inferd.serving.interface import EmbeddingInputError, EmbeddingModel

MAX_INPUTS = 2048  # items in one request, as OpenAI allows
MAX_TOTAL_TOKENS = 300_000  # tokens over all inputs of one request, as OpenAI allows
_SHAPES = "a string, a list of strings, a list of token ids or a list of token-id lists"


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    input: Any = None  # checked here, for messages that name the element at fault
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: WholeInt | None = None
    user: str | None = None


async def create_embedding(request: Request) -> Response:
    state: ServerState = request.app.state.inferd
    body = parse_body(await request.body(), EmbeddingRequest)
    model = state.resolve_embedding_model(body.model)
    if body.dimensions is not None and body.dimensions != model.dimensions:
        raise bad_request(
            f"dimensions: {model.id} returns {model.dimensions}-dimensional vectors and cannot "
            f"resize them to {body.dimensions}; leave dimensions out",
            "dimensions",
        )
    texts, token_inputs = _split_input(body.input)
    inputs = token_inputs
    if texts is not None:
        inputs = await asyncio.to_thread(model.tokenize, texts)
    _check(model, inputs)
    try:
        vectors = await model.embed_async(inputs)
    except RuntimeError as exc:  # shut down under us (unloaded)
        raise APIError(503, str(exc), param="model", code="model_unavailable") from None
    as_base64 = body.encoding_format == "base64"
    data = [
        {"object": "embedding", "index": i, "embedding": _base64(v) if as_base64 else v}
        for i, v in enumerate(vectors)
    ]
    tokens = sum(len(ids) for ids in inputs)
    timer = request_timer(request)  # the access log line and token counters
    timer.model, timer.prompt_tokens = model.id, tokens
    if timer.metrics is not None:
        timer.metrics.tokens_in.labels(model.id).inc(tokens)
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": model.id,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


def _split_input(raw: Any) -> tuple[list[str] | None, list[list[int]]]:
    """(texts, []) for text input, (None, token-id lists) for ids; 400s name the element."""
    if raw is None:
        raise bad_request("input: is required", "input")
    if isinstance(raw, str):
        if not raw:
            raise bad_request("input: must not be an empty string", "input")
        return [raw], []
    if not isinstance(raw, list):
        raise bad_request(f"input: expected {_SHAPES}", "input")
    if not raw:
        raise bad_request("input: must not be an empty list", "input")
    if len(raw) > MAX_INPUTS:
        raise bad_request(f"input: {len(raw)} items; at most {MAX_INPUTS} per request", "input")
    if all(isinstance(x, str) for x in raw):
        for i, text in enumerate(raw):
            if not text:
                raise bad_request(f"input[{i}]: must not be an empty string", "input")
        return list(raw), []
    if all(_is_token(x) for x in raw):
        return None, [list(raw)]
    if all(isinstance(x, list) for x in raw):
        for i, ids in enumerate(raw):
            if not ids:
                raise bad_request(f"input[{i}]: must not be an empty list", "input")
            if not all(_is_token(t) for t in ids):
                raise bad_request(f"input[{i}]: expected a list of token ids", "input")
        return None, [list(x) for x in raw]
    raise bad_request(
        f"input: expected {_SHAPES}; this list mixes kinds or holds other values", "input"
    )


def _is_token(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check(model: EmbeddingModel, inputs: list[list[int]]) -> None:
    try:
        model.check(inputs)
    except EmbeddingInputError as exc:
        raise bad_request(str(exc), exc.param, code=exc.code) from None
    total = sum(len(ids) for ids in inputs)
    if total > MAX_TOTAL_TOKENS:
        raise bad_request(
            f"input: {total} tokens in all; at most {MAX_TOTAL_TOKENS} per request", "input"
        )


def _base64(vector: list[float]) -> str:
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
