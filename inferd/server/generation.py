"""What the generating routes share: sampling parameters, admission, running n generations.

A request for ``n`` choices (or several prompts) becomes independent engine requests sharing
the prompt; ``collect`` gathers them all (aborting every one if the client leaves) and
``stream_events`` frames their merged events (events.py) the way every OpenAI-style stream
ends. Either way, leaving early aborts every engine request, which frees its KV blocks at the
next step.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from starlette.requests import Request

from inferd.host_memory import release_free_heap
from inferd.media.types import DecodedAudio, DecodedImage, DecodedMedia, DecodedVideo
from inferd.server import sse
from inferd.server.api_limits import check_sampling_limits
from inferd.server.errors import bad_request
from inferd.server.events import (
    ENGINE_ERRORS,
    Failure,
    KeepAlive,
    Piece,
    engine_error,
    events,
    failed,
    output_error,
)
from inferd.server.limits import request_deadline
from inferd.server.metrics import RequestTimer, request_timer
from inferd.server.protocol import SamplingFields
from inferd.serving.interface import (
    ChatTemplateError,
    MediaInput,
    NoChatTemplateError,
    RenderedChat,
    RequestOutput,
    SamplingParamError,
    SamplingParams,
    TokenLogprob,
)
from inferd.serving.multimodal import ImageItem, MediaPromptError
from inferd.serving.served import ServedModel

LOGPROB_FLOOR = -9999.0  # JSON has no -inf
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

T = TypeVar("T")
_MASK64 = 2**64 - 1
# Texts this long leave the allocator holding their tokenizer's scratch memory; it is given back.
_TRIM_AFTER_CHARS = 1 << 20


def sampling_params(
    body: SamplingFields,
    model: ServedModel,
    *,
    max_tokens: int,
    logprobs: int | None,
    param_names: dict[str, str] | None = None,
) -> SamplingParams:
    """SamplingParams from the fields chat and text completions share; 400s name the field.

    ``param_names`` maps a SamplingParams field to the request field it came from.
    """
    names = param_names or {}
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    seed = body.seed if body.seed is not None else model.engine_config.seed
    if seed is not None and not -(2**63) <= seed <= _MASK64:
        raise bad_request(f"seed must be a 64-bit integer, got {seed}", "seed")
    top_k = body.top_k or 0
    try:
        check_sampling_limits(stop, logprobs)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if top_k == -1 else top_k,  # -1: "off", as vLLM clients send it
            min_p=body.min_p or 0.0,
            seed=choice_seed(seed, 0),
            stop=stop,
            ignore_eos=bool(body.ignore_eos),
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=(
                1.0 if body.repetition_penalty is None else body.repetition_penalty
            ),
            logit_bias=_logit_bias(body.logit_bias, model.tokenizer.vocab_size),
            logprobs=logprobs,
        )
    except SamplingParamError as exc:
        param = names.get(exc.param, exc.param)
        message = str(exc)
        if param != exc.param:
            message = param + message.removeprefix(exc.param)
        raise bad_request(message, param) from None


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    pairs = []
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(
                f"logit_bias keys must be token ids, got {key!r}", "logit_bias"
            ) from None
        if not 0 <= token < vocab_size:
            raise bad_request(
                f"logit_bias token id {token} is outside this model's vocabulary [0, {vocab_size})",
                "logit_bias",
            )
        pairs.append((token, float(value)))
    return tuple(sorted(pairs))


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index``: the request's own for choice 0, distinct mixes after."""
    if seed is None:
        return None
    if index == 0:
        return seed % 2**63
    x = (seed + index * 0x9E3779B97F4A7C15) & _MASK64  # splitmix64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def for_choice(params: SamplingParams, index: int) -> SamplingParams:
    return params if index == 0 else replace(params, seed=choice_seed(params.seed, index))


def admit(
    model: ServedModel, num_prompt_tokens: int, params: SamplingParams, prompt_param: str
) -> None:
    if num_prompt_tokens == 0:
        raise bad_request(f"{prompt_param}: the prompt is empty after tokenization", prompt_param)
    try:
        model.engine.check_admission(num_prompt_tokens, params)
    except ENGINE_ERRORS as exc:
        raise engine_error(exc) from None


def room_for(
    model: ServedModel,
    num_prompt_tokens: int,
    prompt_param: str,
    *,
    advice: str = "shorten the prompt",
) -> int:
    """The tokens a request without max_tokens may generate: what its prompt leaves of the
    context and the KV pool. A 400 naming the prompt, ending in ``advice``, when it leaves
    none (then no max_tokens could help)."""
    room = model.engine.room(num_prompt_tokens)
    if room == 0 and num_prompt_tokens > 0:
        raise bad_request(
            f"{prompt_param}: the prompt is {num_prompt_tokens} tokens, which leaves no room to "
            f"generate: this model's maximum context length is {model.engine.max_model_len} "
            f"tokens; {advice}",
            prompt_param,
            code="context_length_exceeded",
        )
    return room


def check_fits(model: ServedModel, num_chars: int, prompt_param: str) -> None:
    """Refuse, before tokenizing, a prompt whose characters cannot fit the context.

    A token stands for at most ``max_chars_per_token`` characters, so the prompt needs at least
    num_chars / that many tokens: tokenizing a 7 MB prompt only to refuse it costs seconds of
    CPU and gigabytes of memory.
    """
    per_token = model.tokenizer.max_chars_per_token
    limit = model.engine.max_model_len
    if per_token is None or math.ceil(num_chars / per_token) <= limit:
        return
    raise bad_request(
        f"{prompt_param}: the prompt is {num_chars} characters, at least "
        f"{math.ceil(num_chars / per_token)} tokens (a token of this model covers at most "
        f"{per_token} characters); this model's context is {limit} tokens",
        prompt_param,
        code="context_length_exceeded",
    )


def encode_text(
    model: ServedModel,
    text: str,
    *,
    add_special: bool = True,
    literal_spans: Sequence[tuple[int, int]] = (),
) -> list[int]:
    """Token ids of ``text`` (call off the event loop); memory a long text took is given back."""
    ids = model.tokenizer.encode(text, add_special=add_special, literal_spans=literal_spans)
    if len(text) >= _TRIM_AFTER_CHARS:
        release_free_heap()
    return ids


async def chat_prompt_ids(
    model: ServedModel,
    messages: list[dict[str, object]],
    *,
    special_in_content: bool,
    prefill: str = "",
    add_generation_prompt: bool = True,
    add_special: bool = True,
    check_length: bool = True,
    tools: list[dict[str, Any]] | None = None,
    variables: Mapping[str, Any] | None = None,
) -> list[int]:
    """Render and tokenize a conversation on a worker thread; 400s for a template failure or
    (``check_length``) a prompt too long to fit the context, found before tokenizing.
    ``tools``: the template's ``tools`` variable (a template that renders tools itself)."""

    def work() -> list[int]:
        rendered = _render(
            model, messages, add_generation_prompt, prefill, special_in_content, tools, variables
        )
        if check_length:
            check_fits(model, len(rendered.text), "messages")
        return encode_text(
            model, rendered.text, add_special=add_special, literal_spans=rendered.literal_spans
        )

    return await asyncio.to_thread(work)


async def chat_prompt_with_media(
    model: ServedModel,
    messages: list[dict[str, object]],
    media: Sequence[DecodedMedia],
    *,
    special_in_content: bool,
    prefill: str = "",
    check_length: bool = True,
    tools: list[dict[str, Any]] | None = None,
    variables: Mapping[str, Any] | None = None,
) -> tuple[list[int], list[MediaInput]]:
    """``chat_prompt_ids`` for a conversation whose image, audio and video parts are
    ``{"type": "image"}``, ``{"type": "audio"}`` and ``{"type": "video"}`` (one per decoded
    item of ``media``, in order), and the MediaInputs to submit with the ids. On a worker
    thread too: tiling images and computing audio features cost CPU. A prompt and media that
    disagree (a marker typed as text with --special-tokens-in-content, too many tiles, images
    and audio in one prompt) is a 400."""
    items: list[ImageItem | DecodedAudio | DecodedVideo] = [
        (m.image, m.digest) if isinstance(m, DecodedImage) else m for m in media
    ]
    if not items:
        ids = await chat_prompt_ids(
            model,
            messages,
            special_in_content=special_in_content,
            prefill=prefill,
            check_length=check_length,
            tools=tools,
            variables=variables,
        )
        return ids, []

    def work() -> tuple[list[int], list[MediaInput]]:
        rendered = _render(model, messages, True, prefill, special_in_content, tools, variables)
        if check_length:
            check_fits(model, len(rendered.text), "messages")
        try:
            return model.prompt(rendered.text, items, literal_spans=rendered.literal_spans)
        except MediaPromptError as exc:
            raise bad_request(f"messages: {exc}", "messages") from None

    return await asyncio.to_thread(work)


def _render(
    model: ServedModel,
    messages: list[dict[str, object]],
    add_generation_prompt: bool,
    prefill: str,
    special_in_content: bool,
    tools: list[dict[str, Any]] | None = None,
    variables: Mapping[str, Any] | None = None,
) -> RenderedChat:
    """The conversation's prompt text; 400s for a template that is missing or fails.
    ``tools``: the template's ``tools`` variable (a template that renders tools itself);
    ``variables``: more template variables (``enable_thinking``, ...)."""
    try:
        return model.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            prefill=prefill,
            special_in_content=special_in_content,
            tools=tools,
            variables=variables,
        )
    except NoChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from None
    except ChatTemplateError as exc:
        message = f"the chat template could not render these messages: {exc}"
        raise bad_request(message, "messages") from None


def start(
    request: Request,
    model: ServedModel,
    jobs: Sequence[tuple[list[int], SamplingParams]],
    media: Sequence[MediaInput] = (),
) -> list[AsyncIterator[RequestOutput]]:
    """One engine request per (prompt ids, params), admitted at once. Each stream is bounded
    by the request's deadline (--request-timeout) and observed by its timer (metrics, access
    log); closing it aborts the engine request. ``media``: the images of the prompt (from
    ``ServedModel.prompt``), shared by every job."""
    tag = uuid.uuid4().hex[:8]
    deadline = request_deadline(request.scope)
    timer = request_timer(request)
    streams = []
    for i, (prompt, params) in enumerate(jobs):
        request_id = f"{request.state.request_id}-{tag}-{i}"
        stream = model.engine.submit(
            prompt, model.adapted(params), request_id=request_id, media=media
        )
        bounded = stream if deadline is None else deadline.bound(stream)
        streams.append(timer.watch(bounded, model.id))
    return streams


@dataclass(slots=True)
class Generation:
    """One engine request's outputs, accumulated."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    last: RequestOutput | None = None
    outputs: list[RequestOutput] = field(default_factory=list)  # as they came, to replay

    def add(self, out: RequestOutput) -> None:
        self.outputs.append(out)
        self.text += out.text
        self.token_ids.extend(out.token_ids)
        self.logprobs.extend(visible_logprobs(out))
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.last = out

    @property
    def final(self) -> RequestOutput:
        assert self.last is not None
        return self.last


def visible_logprobs(out: RequestOutput) -> list[TokenLogprob]:
    """An output's logprobs, less the end-of-turn / stop token that ended it (never shown)."""
    lps = list(out.logprobs or ())
    ended_on_token = out.finished and isinstance(out.stop_reason, int)
    if lps and ended_on_token and out.token_ids and out.token_ids[-1] == out.stop_reason:
        lps.pop()
    return lps


async def collect(
    request: Request, streams: Sequence[AsyncIterator[RequestOutput]]
) -> list[Generation] | None:
    """Run every stream to the end; None when the client went away first (all aborted)."""

    async def one(stream: AsyncIterator[RequestOutput]) -> Generation:
        gen = Generation()
        async for out in stream:
            gen.add(out)
        return gen

    async def every() -> list[Generation]:
        tasks = [asyncio.ensure_future(one(s)) for s in streams]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    try:
        gens = await unless_disconnected(request, every())
    except ENGINE_ERRORS as exc:
        raise engine_error(exc) from None
    if gens is None:
        return None
    for gen in gens:
        if failed(gen.final):
            raise output_error(gen.final)
    return gens


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """``work``'s result; None when the client goes away first, and then ``work`` is cancelled
    (as it is when this handler is: a timeout)."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                return None
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return task.result()


async def stream_events(
    streams: Sequence[AsyncIterator[RequestOutput]],
    keepalive: float,
    on_output: Callable[[int, RequestOutput], Iterable[bytes]],
    usage: Callable[[int], dict[str, Any]] | None = None,
    timer: RequestTimer | None = None,
) -> AsyncIterator[bytes]:
    """The body of an OpenAI-style SSE stream over every choice's engine stream.

    ``on_output(choice index, output)`` turns each output into events, with a keep-alive
    comment whenever ``keepalive`` seconds pass without one. ``usage(total output tokens)``
    is the usage chunk, given when the caller asked for one: after the last output, before
    ``[DONE]``. A failure ends the stream with an error event and ``[DONE]``; when the caller
    asked for usage, the error event carries the chunk's ``usage`` too, counting what was
    generated before the failure, so a client can reconcile a run the server cut short. A
    middleware that cuts the stream itself (a shutdown) finds ``usage`` on the request's
    ``timer`` and puts it on its error event the same way.
    """
    if timer is not None:
        timer.usage_chunk = usage
    async for event in events(streams, keepalive):
        if isinstance(event, Piece):
            for frame in on_output(event.index, event.output):
                yield frame
        elif isinstance(event, KeepAlive):
            yield sse.KEEPALIVE
        elif isinstance(event, Failure):
            body = openai_error(event)
            if usage is not None:
                body["usage"] = usage(event.output_tokens)["usage"]
            yield sse.event(body)
            yield sse.DONE
            return
        elif usage is not None:
            yield sse.event(usage(event.output_tokens))
    yield sse.DONE


def openai_error(failure: Failure) -> dict[str, object]:
    """The OpenAI-style body of an error that happens after a stream has started."""
    body = failure.error.body()
    if failure.engine_fault:
        body["error"] |= {"type": "server_error"}
    return body


def token_piece(model: ServedModel, token_id: int) -> str:
    """A token's text; a piece of a multi-byte character shows as U+FFFD (bytes are exact)."""
    return model.tokenizer.id_to_bytes(token_id).decode("utf-8", errors="replace")


def clamp(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)
