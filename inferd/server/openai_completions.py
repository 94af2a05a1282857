"""POST /v1/completions: OpenAI's legacy text completions, JSON or SSE.

``prompt`` is a string, a list of strings, a list of token ids or a list of token-id lists;
each prompt gets ``n`` choices, numbered prompt-major (choice ``p * n + i``).

``echo`` with ``logprobs`` scores the prompt too (the engine's prompt logprobs): the choice's
logprobs then cover prompt and completion tokens, the first prompt token with a null logprob
and null top_logprobs as in OpenAI. The prompt is scored once, by its first choice; the other
choices of that prompt repeat its scores. Streamed, a choice's echo goes out once the scores
are known (its first output, or its first choice's), its later outputs held back until then.

The response a request can cause is bounded: ``n`` x scored tokens x (1 + ``logprobs``)
(token, logprob) pairs may not exceed the server's ``max_logprobs_tokens`` (400 beyond).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from inferd.server import sse
from inferd.server.api_limits import LogprobsAsk, check_logprobs_size, check_n
from inferd.server.constraints import checked_constraint, compiled
from inferd.server.errors import bad_request
from inferd.server.generation import (
    SSE_HEADERS,
    admit,
    check_fits,
    clamp,
    collect,
    for_choice,
    room_for,
    sampling_params,
    start,
    stream_events,
    token_piece,
    visible_logprobs,
)
from inferd.server.metrics import RequestTimer, request_timer
from inferd.server.pipeline import RawPrompt, tokenize_prompts
from inferd.server.protocol import CompletionRequest, parse_body
from inferd.server.state import ServerState
from inferd.serving.interface import RequestOutput, TokenLogprob
from inferd.serving.served import ServedModel

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint

_PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of token-id lists"


async def create_completion(request: Request) -> Response:
    state: ServerState = request.app.state.inferd
    body = parse_body(await request.body(), CompletionRequest)
    model = state.resolve_model(body.model)
    _reject_unsupported(body)
    # The cheap checks first (the prompts' shapes and lengths, n, sampling, the constraint's
    # fields), then the costly steps in the pipeline's order: tokenize, compile, budget, admit.
    raw = _raw_prompts(body.prompt, model)
    n = check_n(body.n, len(raw))
    if body.best_of is not None and body.best_of != n:
        raise bad_request(
            f"best_of={body.best_of} is not supported; leave it out or set it equal to n", "best_of"
        )
    asked = body.max_tokens
    params = sampling_params(
        body, model, max_tokens=1 if asked is None else asked, logprobs=body.logprobs
    )
    constraint = await checked_constraint(body)
    prompts = await asyncio.to_thread(tokenize_prompts, raw, model)
    params = await compiled(model, params, constraint)
    max_tokens = asked
    if max_tokens is None:  # OpenAI's default, within what the longest prompt leaves
        param = "prompt" if len(prompts) == 1 else "prompt.{i}"
        room = min(
            room_for(model, len(p.token_ids), param.format(i=i)) for i, p in enumerate(prompts)
        )
        max_tokens = min(DEFAULT_MAX_TOKENS, room)
    params = replace(params, max_tokens=max_tokens)
    score_prompt = bool(body.echo) and body.logprobs is not None
    if body.logprobs is not None:
        _check_response_size(
            state.max_logprobs_tokens, prompts, n, max_tokens, body.logprobs, score_prompt
        )
    # Only each prompt's first choice scores it: the others repeat its prompt logprobs.
    scored = replace(params, prompt_logprobs=body.logprobs) if score_prompt else params
    for prompt in prompts:
        admit(model, len(prompt.token_ids), scored, "prompt")
    jobs = [
        (p.token_ids, for_choice(scored if i == 0 else params, i))
        for p in prompts
        for i in range(n)
    ]
    streams = start(request, model, jobs)  # bounded by the deadline, observed by the timer
    echoes = [p.text if body.echo else "" for p in prompts for _ in range(n)]
    prompt_ids = [p.token_ids for p in prompts for _ in range(n)]
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
            prompt_ids if score_prompt else None,
            n,
            num_prompt_tokens,
            include_usage,
            state.keepalive_seconds,
            request_timer(request),
        )
        return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)
    gens = await collect(request, streams)
    if gens is None:
        return Response(status_code=499)
    want_logprobs = body.logprobs is not None
    choices = []
    echoed: dict[int, dict[str, Any]] = {}  # first choice of a prompt -> its echo's logprobs
    for index, (gen, echo) in enumerate(zip(gens, echoes, strict=True)):
        lps = _logprobs(model, gen.logprobs, len(echo)) if want_logprobs else None
        first = index - index % n
        prompt_scores = gens[first].prompt_logprobs  # only the prompt's first choice scores it
        if lps is not None and score_prompt and prompt_scores is not None:
            if first not in echoed:  # built once per prompt, shared by its n choices
                echoed[first] = _prompt_logprobs(model, prompt_ids[index], prompt_scores, len(echo))
            lps = {key: echoed[first][key] + lps[key] for key in lps}
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
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def _raw_prompts(raw: Any, model: ServedModel) -> list[tuple[str | list[int], str]]:
    """The prompts as sent, each with the field it came from, their shapes checked (text that
    cannot fit the context, token ids outside the vocabulary); nothing tokenized yet."""
    if raw is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(raw, str):
        prompts: list[tuple[str | list[int], str]] = [(raw, "prompt")]
    elif not isinstance(raw, list) or not raw:
        what = "an empty list" if raw == [] else type(raw).__name__
        raise bad_request(f"prompt must be {_PROMPT_SHAPES}, got {what}", "prompt")
    elif all(isinstance(p, str) for p in raw) or all(
        isinstance(p, list) and all(_is_token_id(t) for t in p) for p in raw
    ):
        prompts = [(p, f"prompt.{i}") for i, p in enumerate(raw)]
    elif all(_is_token_id(t) for t in raw):
        prompts = [(raw, "prompt")]
    else:
        raise bad_request(f"prompt must be {_PROMPT_SHAPES}", "prompt")
    for prompt, param in prompts:
        if isinstance(prompt, str):
            check_fits(model, len(prompt), param)
        else:
            _check_token_ids(prompt, model, param)
    return prompts


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_token_ids(ids: list[int], model: ServedModel, param: str) -> None:
    vocab = model.tokenizer.vocab_size
    for token in ids:
        if not 0 <= token < vocab:
            raise bad_request(
                f"{param}: token id {token} is outside this model's vocabulary [0, {vocab})", param
            )


def _check_response_size(
    limit: int, prompts: Sequence[RawPrompt], n: int, max_tokens: int, k: int, echo: bool
) -> None:
    """400 when the logprobs this request asks for could exceed ``limit`` pairs."""
    scored = sum((len(p.token_ids) if echo else 0) + max_tokens for p in prompts)
    advice = "lower n, logprobs or max_tokens, or leave out echo"
    what = "echoed prompt and completion tokens" if echo else "completion tokens"
    check_logprobs_size(limit, LogprobsAsk(n, k, "logprobs", advice), scored, what)


def _usage(num_prompt_tokens: int, num_output_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
    }


def _logprobs(model: ServedModel, lps: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
    """OpenAI's legacy logprobs: parallel lists; each top dict also holds the sampled token."""
    return _legacy_logprobs(model, [(lp.token_id, lp) for lp in lps], offset)


def _prompt_logprobs(
    model: ServedModel,
    token_ids: Sequence[int],
    lps: Sequence[TokenLogprob | None],
    echo_len: int,
) -> dict[str, Any]:
    """The legacy logprobs of the echoed prompt; the first token's are null, as in OpenAI.

    Offsets stay within the echoed text (a BOS token the tokenizer added is not in it).
    """
    out = _legacy_logprobs(model, list(zip(token_ids, lps, strict=True)), 0)
    out["text_offset"] = [min(o, echo_len) for o in out["text_offset"]]
    return out


def _legacy_logprobs(
    model: ServedModel, entries: Sequence[tuple[int, TokenLogprob | None]], offset: int
) -> dict[str, Any]:
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for token_id, lp in entries:
        piece = token_piece(model, token_id)
        tokens.append(piece)
        text_offset.append(offset)
        offset += len(piece)
        if lp is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        top = {token_piece(model, t): clamp(v) for t, v in lp.top}
        top.setdefault(piece, clamp(lp.logprob))
        token_logprobs.append(clamp(lp.logprob))
        top_logprobs.append(top)
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
    prompt_ids: list[list[int]] | None,
    n: int,
    num_prompt_tokens: int,
    include_usage: bool,
    keepalive: float,
    timer: RequestTimer,
) -> AsyncIterator[bytes]:
    """``prompt_ids`` (one per choice) when the echo carries prompt logprobs; choice ``i``'s
    come from choice ``i - i % n``, the first of its prompt; ``timer``: the request's (a
    shutdown's cut reports the usage it counted)."""
    offsets = [len(e) for e in echoes]
    echo_pending = [bool(e) and prompt_ids is not None for e in echoes]
    scores: dict[int, tuple[TokenLogprob | None, ...]] = {}  # first choice -> prompt logprobs
    held: dict[int, list[tuple[int, RequestOutput]]] = {}  # first choice -> waiting outputs
    echoed: dict[int, dict[str, Any]] = {}  # first choice -> its echo's legacy logprobs

    def chunk(index: int, text: str, finish: str | None, lps: Any = None) -> bytes:
        choice = {"index": index, "text": text, "logprobs": lps, "finish_reason": finish}
        body = envelope | {"choices": [choice]}
        if include_usage:
            body["usage"] = None
        return sse.event(body)

    def on_output(index: int, out: RequestOutput) -> Iterator[bytes]:
        first = index - index % n
        if out.prompt_logprobs is not None:
            scores[first] = out.prompt_logprobs
        if echo_pending[index] and first not in scores:
            held.setdefault(first, []).append((index, out))  # its echo needs the scores
            return
        yield from emit(index, out)
        for sibling, output in held.pop(first, []) if first in scores else []:
            yield from emit(sibling, output)

    def emit(index: int, out: RequestOutput) -> Iterator[bytes]:
        if echo_pending[index]:
            echo_pending[index] = False
            prompt = None
            if prompt_ids is not None:
                first = index - index % n
                if first not in echoed:  # built once per prompt, shared by its n choices
                    echoed[first] = _prompt_logprobs(
                        model, prompt_ids[index], scores[first], len(echoes[index])
                    )
                prompt = echoed[first]
            yield chunk(index, echoes[index], None, prompt)
        lps = None
        if out.logprobs is not None:
            visible = visible_logprobs(out)
            lps = _logprobs(model, visible, offsets[index])
            offsets[index] += sum(len(p) for p in lps["tokens"])
        if out.text or (lps and lps["tokens"]) or out.finished:
            yield chunk(index, out.text, out.finish_reason, lps)

    def usage(output_tokens: int) -> dict[str, Any]:
        return envelope | {"choices": [], "usage": _usage(num_prompt_tokens, output_tokens)}

    for index, echo in enumerate(echoes):
        if echo and not echo_pending[index]:
            yield chunk(index, echo, None)
    async for event in stream_events(
        streams, keepalive, on_output, usage if include_usage else None, timer
    ):
        yield event
