"""One path from a translated request to the engine, the same for every chat-shaped protocol.

Chat completions, Anthropic messages and the Responses API each translate their body into a
``ChatJob``, and every check that costs nothing (fields, ``n``, sampling, logprobs, tools, the
output constraint's fields, the conversation's shape) is done while translating. ``prepare``
then runs the costly steps, in this order for all of them:

1. media: fetched and decoded under the request's media policy;
2. prompt: the conversation rendered by the chat template and tokenized, with the media;
3. constraint: the output constraint's grammar compiled;
4. budget: ``max_tokens`` checked or, when not given, the room the prompt leaves;
5. admission: the engine's own limits;
6. reasoning: how the reply splits into reasoning and answer.

``submit`` starts the engine streams. Text completions' raw prompts take the same order
without a conversation: ``tokenize_prompts`` is their step 2. A protocol names its own fields
in errors: a job carries how (``ErrorNames``), so every step raises in the caller's terms.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.requests import Request

from inferd.media.types import DecodedMedia
from inferd.server.api_limits import LogprobsAsk, check_logprobs_size
from inferd.server.constraints import compiled
from inferd.server.errors import APIError
from inferd.server.events import ENGINE_ERRORS, engine_error
from inferd.server.generation import (
    admit,
    chat_prompt_with_media,
    encode_text,
    for_choice,
    room_for,
    start,
)
from inferd.server.media import decode_request_media, media_policy
from inferd.server.reasoning import ReasoningSplit, followed
from inferd.server.state import ServerState
from inferd.serving.interface import MediaInput, RequestOutput, SamplingParams
from inferd.serving.served import ServedModel
from inferd.structured.constraint import Constraint


def _same(err: APIError) -> APIError:
    return err


@dataclass(frozen=True, slots=True)
class ErrorNames:
    """How a protocol names what the steps' errors are about."""

    prompt_param: str = "messages"  # the field holding the conversation
    media: Callable[[APIError], APIError] = _same  # a part's error, in the protocol's paths
    prompt: Callable[[APIError], APIError] = _same  # a template or prompt error
    constraint: Callable[[APIError], APIError] = _same  # a grammar that does not compile
    no_room: str = "shorten the prompt"  # what to do about a prompt that leaves no room


@dataclass(frozen=True, slots=True)
class ChatJob:
    """A chat-shaped request in no protocol's terms, its cheap checks done."""

    messages: list[dict[str, Any]]  # the conversation as the chat template takes it
    media_parts: Sequence[Any]  # the request's messages holding its media parts, in order
    params: SamplingParams  # checked; ``max_tokens`` is a placeholder while ``max_tokens`` is None
    max_tokens: int | None  # as asked; None: the room the prompt leaves
    constraint: Constraint | None = None  # checked; compiled by ``prepare``
    constraint_param: str | None = None  # the field a compile error names (None: by kind)
    tools: list[dict[str, Any]] | None = None  # the template's ``tools`` variable
    variables: Mapping[str, Any] = field(default_factory=dict)  # more template variables
    prefill: str = ""  # the start of the reply (an assistant turn ending the conversation)
    n: int = 1  # independent choices sharing the prompt
    logprobs: LogprobsAsk | None = None  # the logprobs asked for, bounding the reply's length
    reasoning: bool = True  # split the reply where the model thinks
    thinking_budget: int | None = None  # reasoning tokens before the think block is closed
    truncate: bool = False  # drop the oldest turns until the reply has room
    # The decoded media in the order the rendered conversation holds them (None: as decoded).
    in_prompt_order: Callable[[list[DecodedMedia]], list[DecodedMedia]] | None = None
    names: ErrorNames = field(default_factory=ErrorNames)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A job ready to submit: its prompt, media and final sampling parameters."""

    prompt: list[int]
    media: list[MediaInput]
    params: SamplingParams  # constraint compiled, max_tokens settled, the think block followed
    thinking: ReasoningSplit | None  # how the reply splits, or None
    n: int = 1
    decoded: list[DecodedMedia] = field(default_factory=list)  # step 1's media, for a next round
    earlier_prompt_tokens: int = 0  # prompt tokens of the agent loop's earlier rounds

    @property
    def prompt_tokens(self) -> int:
        """The prompt tokens the request is charged: this prompt's, and earlier rounds'."""
        return len(self.prompt) + self.earlier_prompt_tokens


async def prepare(
    request: Request,
    model: ServedModel,
    job: ChatJob,
    decoded: list[DecodedMedia] | None = None,
) -> Prepared:
    """The costly steps of ``job``, in the module's order; APIError in the caller's terms.
    ``decoded``: the job's media decoded already (an agent loop's next round), step 1 skipped."""
    state: ServerState = request.app.state.inferd
    media = await _decoded(request, model, job) if decoded is None else decoded
    prompt, inputs = await _prompt(model, job, state, media)
    try:
        params = await compiled(model, job.params, job.constraint, job.constraint_param)
    except APIError as exc:
        raise job.names.constraint(exc) from None
    params = _budget(model, job, params, len(prompt), state.max_logprobs_tokens)
    admit(model, len(prompt), params, job.names.prompt_param)
    thinking = state.reasoning(model, prompt) if job.reasoning else None
    params = followed(params, model, thinking, job.thinking_budget)
    return Prepared(prompt, inputs, params, thinking, job.n, media)


async def render(
    request: Request, model: ServedModel, job: ChatJob
) -> tuple[list[int], list[MediaInput]]:
    """Steps 1 and 2 alone: the prompt's token ids and the media to submit with them (what
    counting a request's tokens needs)."""
    state: ServerState = request.app.state.inferd
    return await _prompt(model, job, state, await _decoded(request, model, job))


async def _decoded(request: Request, model: ServedModel, job: ChatJob) -> list[DecodedMedia]:
    """Step 1: the job's media fetched and decoded, in the rendered conversation's order."""
    try:
        media = await decode_request_media(
            job.media_parts,
            media_policy(request),
            model,
            audio_rate=model.audio_sample_rate,
            video_sampling=model.video_sampling,
        )
    except APIError as exc:
        raise job.names.media(exc) from None
    if job.in_prompt_order is not None:
        media = job.in_prompt_order(media)
    return media


def submit(
    request: Request, model: ServedModel, ready: Prepared
) -> list[AsyncIterator[RequestOutput]]:
    """One engine stream per choice, the choices sharing the prompt and its media."""
    jobs = [(ready.prompt, for_choice(ready.params, i)) for i in range(ready.n)]
    return start(request, model, jobs, media=ready.media)


def submit_detached(
    model: ServedModel, ready: Prepared, request_id: str
) -> AsyncIterator[RequestOutput]:
    """One engine stream tied to no HTTP request (no deadline, no request timer): a
    background job the client polls for. A 503 now when the engine cannot take it."""
    try:
        return model.engine.submit(
            ready.prompt, model.adapted(ready.params), request_id=request_id, media=ready.media
        )
    except ENGINE_ERRORS as exc:
        raise engine_error(exc) from None


@dataclass(frozen=True, slots=True)
class RawPrompt:
    """A text completion's prompt: its token ids, and what ``echo`` repeats (the string as
    sent, or the token ids sent, decoded)."""

    token_ids: list[int]
    text: str


def tokenize_prompts(
    raw: Sequence[tuple[str | list[int], str]], model: ServedModel
) -> list[RawPrompt]:
    """Each raw prompt's token ids (call off the event loop). A text prompt is the prompt as
    the caller wrote it: special-token text in it is read as such (the caller owns the whole
    prompt); token ids are decoded for ``echo``."""
    return [
        RawPrompt(encode_text(model, p), p)
        if isinstance(p, str)
        else RawPrompt(list(p), model.tokenizer.decode(p))
        for p, _ in raw
    ]


async def _prompt(
    model: ServedModel, job: ChatJob, state: ServerState, media: list[DecodedMedia]
) -> tuple[list[int], list[MediaInput]]:
    """The prompt's ids and the media to submit with them. With ``job.truncate`` the oldest
    turns (and their media) are dropped, never a leading system turn nor the last turn, until
    the reply has room."""
    messages, needed = job.messages, job.max_tokens or 1
    while True:
        try:
            prompt, inputs = await chat_prompt_with_media(
                model,
                messages,
                media,
                special_in_content=state.special_tokens_in_content,
                prefill=job.prefill,
                check_length=not job.truncate,
                tools=job.tools,
                variables=job.variables,
            )
        except APIError as exc:
            raise job.names.prompt(exc) from None
        lead = 1 if messages and messages[0]["role"] in ("system", "developer") else 0
        if (
            not job.truncate
            or model.engine.room(len(prompt)) >= needed
            or len(messages) - lead <= 1
        ):
            return prompt, inputs
        media = media[_media_in(messages[lead]) :]
        messages = messages[:lead] + messages[lead + 1 :]


def _media_in(message: dict[str, Any]) -> int:
    content = message.get("content")
    if not isinstance(content, list):
        return 0
    return sum(1 for p in content if p.get("type") in ("image", "audio", "video"))


def _budget(
    model: ServedModel, job: ChatJob, params: SamplingParams, num_prompt_tokens: int, limit: int
) -> SamplingParams:
    """``params`` with the reply's length settled: as asked (logprobs beyond the bound are a
    400) or, when not asked, the room the prompt leaves in the context and the KV pool, within
    the logprobs bound."""
    ask = job.logprobs
    if job.max_tokens is not None:
        if ask is not None:
            check_logprobs_size(limit, ask, params.max_tokens, "completion tokens")
        return params
    names = job.names
    room = room_for(model, num_prompt_tokens, names.prompt_param, advice=names.no_room)
    max_tokens = room if ask is None else min(room, ask.most_tokens(limit))
    if ask is not None and max_tokens < 1:
        check_logprobs_size(limit, ask, 1, "completion tokens")  # not even one token fits
    return replace(params, max_tokens=max_tokens)
