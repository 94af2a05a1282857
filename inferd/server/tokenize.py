"""POST /tokenize and /detokenize (vLLM's shapes): text or chat messages <-> token ids.

``/tokenize`` takes either ``prompt`` (raw text) or ``messages`` (rendered with the model's chat
template first, exactly as /v1/chat/completions does, so ``count`` equals that route's
``usage.prompt_tokens``). ``return_token_strs`` adds each token's text piece. A prompt whose
characters cannot fit the model's context is a 400, as on the generating routes.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from inferd.server.errors import bad_request
from inferd.server.generation import chat_prompt_ids, check_fits, encode_text, token_piece
from inferd.server.openai_chat import _messages
from inferd.server.protocol import ChatMessage, _Lenient, parse_body
from inferd.server.state import ServerState
from inferd.serving.served import ServedModel


class TokenizeRequest(_Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[int]


async def tokenize(request: Request) -> Response:
    state: ServerState = request.app.state.inferd
    body = parse_body(await request.body(), TokenizeRequest)
    model = state.resolve_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("send exactly one of prompt or messages", "prompt")
    # Bounded as the generating routes are: a prompt whose characters cannot fit the context is
    # refused before tokenizing (tokenizing holds the GIL: a 15 MB prompt stalled every request
    # for seconds); the count of a prompt past the context comes back while it may be close.
    if body.messages is not None:
        ids = await chat_prompt_ids(
            model,
            _messages(body.messages, model.tool_format),
            special_in_content=state.special_tokens_in_content,
            add_generation_prompt=body.add_generation_prompt,
            add_special=body.add_special_tokens,
        )
    else:
        assert body.prompt is not None
        check_fits(model, len(body.prompt), "prompt")
        ids = await asyncio.to_thread(
            encode_text, model, body.prompt, add_special=body.add_special_tokens
        )
    pieces = None
    if body.return_token_strs:
        pieces = await asyncio.to_thread(lambda: [token_piece(model, t) for t in ids])
    out: dict[str, Any] = {
        "count": len(ids),
        "max_model_len": model.engine.max_model_len,
        "tokens": ids,
        "token_strs": pieces,
    }
    return JSONResponse(out)


async def detokenize(request: Request) -> Response:
    state: ServerState = request.app.state.inferd
    body = parse_body(await request.body(), DetokenizeRequest)
    model = state.resolve_model(body.model)
    _check_ids(body.tokens, model)
    return JSONResponse({"prompt": model.tokenizer.decode(body.tokens)})


def _check_ids(ids: list[int], model: ServedModel) -> None:
    vocab = model.tokenizer.vocab_size
    for i, token in enumerate(ids):
        if not 0 <= token < vocab:
            raise bad_request(
                f"tokens.{i}: token id {token} is outside this model's vocabulary [0, {vocab})",
                f"tokens.{i}",
            )
