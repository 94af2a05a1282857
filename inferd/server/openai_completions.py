"""POST /v1/completions: OpenAI's legacy text completions, JSON or SSE.

``prompt`` is a string, a list of strings, a list of token ids or a list of token-id lists;
each prompt gets ``n`` choices, numbered prompt-major (choice ``p * n + i``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from inferd.engine.builder import ServedModel
from inferd.engine.outputs import RequestOutput, TokenLogprob
from inferd.server import sse
from inferd.server.errors import bad_request
from inferd.server.generation import (
    SSE_HEADERS,
    admit,
    check_n,
    clamp,
    collect,
    error_payload,
    for_choice,
    interleave,
    sampling_params,
    start,
    token_piece,
    visible_logprobs,
)
from inferd.server.protocol import CompletionRequest, parse_body
from inferd.server.state import ServerState

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint

_PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of token-id lists"


@dataclass(frozen=True, slots=True)
class _Prompt:
    token_ids: list[int]
    text: str  # what `echo` repeats: the string as sent, or the decoded token ids


async def create_completion(request: Request) -> Response:
    state: ServerState = request.app.state.inferd
    body = parse_body(await request.body(), CompletionRequest)
    model = state.resolve_model(body.model)
    _reject_unsupported(body)
    prompts = _prompts(body.prompt, model)
    n = check_n(body.n, len(prompts))
    if body.best_of is not None and body.best_of != n:
        raise bad_request(
            f"best_of={body.best_of} is not supported; leave it out or set it equal to n", "best_of"
        )
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    params = sampling_params(body, model, max_tokens=max_tokens, logprobs=body.logprobs)
    for prompt in prompts:
        admit(model, len(prompt.token_ids), params, "prompt")
    jobs = [(p.token_ids, for_choice(params, i)) for p in prompts for i in range(n)]
    streams = start(model, request.state.request_id, jobs)
    echoes = [p.text if body.echo else "" for p in prompts for _ in range(n)]
    num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
    envelope = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model.id,
    }
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = _stream(
            envelope,
            model,
            streams,
            echoes,
            num_prompt_tokens,
            include_usage,
            state.keepalive_seconds,
        )
        return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)
    gens = await collect(request, streams)
    if gens is None:
        return Response(status_code=499)
    want_logprobs = body.logprobs is not None
    choices = []
    for index, (gen, echo) in enumerate(zip(gens, echoes, strict=True)):
        lps = _logprobs(model, gen.logprobs, len(echo)) if want_logprobs else None
        choices.append(
            {
                "index": index,
                "text": echo + gen.text,
                "logprobs": lps,
                "finish_reason": gen.final.finish_reason,
            }
        )
    output_tokens = sum(g.final.num_output_tokens for g in gens)
    return JSONResponse(
        envelope | {"choices": choices, "usage": _usage(num_prompt_tokens, output_tokens)}
    )


def _reject_unsupported(body: CompletionRequest) -> None:
    if body.suffix:
        raise bad_request(
            "suffix is not supported: this server has no fill-in-the-middle mode; "
            "put all the text in prompt",
            "suffix",
        )
    if body.echo and body.logprobs is not None:
        raise bad_request(
            "echo together with logprobs is not supported (prompt logprobs are not computed); "
            "drop one of them",
            "echo",
        )
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def _prompts(raw: Any, model: ServedModel) -> list[_Prompt]:
    if raw is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(raw, str):
        return [_text_prompt(raw, model)]
    if not isinstance(raw, list) or not raw:
        what = "an empty list" if raw == [] else type(raw).__name__
        raise bad_request(f"prompt must be {_PROMPT_SHAPES}, got {what}", "prompt")
    if all(isinstance(p, str) for p in raw):
        return [_text_prompt(p, model) for p in raw]
    if all(_is_token_id(t) for t in raw):
        return [_token_prompt(raw, model, "prompt")]
    if all(isinstance(p, list) and all(_is_token_id(t) for t in p) for p in raw):
        return [_token_prompt(p, model, f"prompt.{i}") for i, p in enumerate(raw)]
    raise bad_request(f"prompt must be {_PROMPT_SHAPES}", "prompt")


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text_prompt(text: str, model: ServedModel) -> _Prompt:
    return _Prompt(model.tokenizer.encode(text, add_special=True), text)


def _token_prompt(ids: list[int], model: ServedModel, param: str) -> _Prompt:
    vocab = model.tokenizer.vocab_size
    for token in ids:
        if not 0 <= token < vocab:
            raise bad_request(
                f"{param}: token id {token} is outside this model's vocabulary [0, {vocab})", param
            )
    return _Prompt(list(ids), model.tokenizer.decode(ids))


def _usage(num_prompt_tokens: int, num_output_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
    }


def _logprobs(model: ServedModel, lps: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
    """OpenAI's legacy logprobs: parallel lists; each top dict also holds the sampled token."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for lp in lps:
        piece = token_piece(model, lp.token_id)
        top = {token_piece(model, t): clamp(v) for t, v in lp.top}
        top.setdefault(piece, clamp(lp.logprob))
        tokens.append(piece)
        token_logprobs.append(clamp(lp.logprob))
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(piece)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


async def _stream(
    envelope: dict[str, Any],
    model: ServedModel,
    streams: list[AsyncIterator[RequestOutput]],
    echoes: list[str],
    num_prompt_tokens: int,
    include_usage: bool,
    keepalive: float,
) -> AsyncIterator[bytes]:
    offsets = [len(e) for e in echoes]

    def chunk(index: int, text: str, finish: str | None, lps: Any = None) -> bytes:
        choice = {"index": index, "text": text, "logprobs": lps, "finish_reason": finish}
        body = envelope | {"choices": [choice]}
        if include_usage:
            body["usage"] = None
        return sse.event(body)

    for index, echo in enumerate(echoes):
        if echo:
            yield chunk(index, echo, None)
    output_tokens = [0] * len(streams)
    try:
        async for item in sse.with_heartbeat(interleave(streams), keepalive):
            if item is None:
                yield sse.KEEPALIVE
                continue
            index, out = item
            if out.finish_reason in ("error", "abort"):
                yield sse.event(error_payload(out))
                yield sse.DONE
                return
            output_tokens[index] = out.num_output_tokens
            lps = None
            if out.logprobs is not None:
                visible = visible_logprobs(out)
                lps = _logprobs(model, visible, offsets[index])
                offsets[index] += sum(len(p) for p in lps["tokens"])
            if out.text or (lps and lps["tokens"]) or out.finished:
                yield chunk(index, out.text, out.finish_reason, lps)
    except Exception as exc:
        yield sse.event(error_payload(exc))
        yield sse.DONE
        return
    if include_usage:
        body = envelope | {"choices": [], "usage": _usage(num_prompt_tokens, sum(output_tokens))}
        yield sse.event(body)
    yield sse.DONE
