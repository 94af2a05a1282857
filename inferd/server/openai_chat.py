"""POST /v1/chat/completions: parse -> engine -> JSON or SSE."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from inferd.engine.async_engine import AdmissionError, EngineBusyError, EngineStoppedError
from inferd.engine.builder import ServedModel
from inferd.engine.outputs import RequestOutput
from inferd.engine.sampling import SamplingParamError, SamplingParams
from inferd.loaders.chat_template import ChatTemplateError
from inferd.server import sse
from inferd.server.errors import APIError, bad_request
from inferd.server.protocol import ChatCompletionRequest, ChatMessage, parse_body
from inferd.server.state import ServerState


async def create_chat_completion(request: Request) -> Response:
    state: ServerState = request.app.state.inferd
    body = parse_body(await request.body(), ChatCompletionRequest)
    model = state.resolve_model(body.model)
    messages = [_message_dict(i, m) for i, m in enumerate(body.messages)]
    params = _sampling_params(body, model)
    try:
        prompt = await asyncio.to_thread(model.chat_prompt, messages)
    except ChatTemplateError as exc:
        message = f"the chat template could not render these messages: {exc}"
        raise bad_request(message, "messages") from None
    if body.max_tokens is None and body.max_completion_tokens is None:
        room = model.engine.max_model_len - len(prompt)
        params = _replace_max_tokens(params, max(1, room))
    _admit(model, len(prompt), params)
    request_id = request.state.request_id
    completion = _Completion(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model.id)
    outputs = model.engine.generate(
        prompt, params, request_id=f"{request_id}-{uuid.uuid4().hex[:8]}"
    )
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = _stream(completion, outputs, include_usage, state.keepalive_seconds)
        return StreamingResponse(stream, media_type="text/event-stream", headers=_SSE_HEADERS)
    return await _collect(request, completion, outputs)


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _message_dict(index: int, message: ChatMessage) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):
        content = _text_of_parts(index, content)
    if content is None and message.role != "assistant":
        raise bad_request(f"messages.{index}.content is required", f"messages.{index}.content")
    out: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name is not None:
        out["name"] = message.name
    return out


def _text_of_parts(index: int, parts: list[dict[str, Any]]) -> str:
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type")
        param = f"messages.{index}.content.{j}"
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"{param}.text must be a string", f"{param}.text")
            texts.append(text)
        elif kind in ("image_url", "input_audio", "audio_url", "video_url", "file"):
            raise bad_request(
                f"{param}: this model takes text only and cannot accept {kind} parts", param
            )
        else:
            raise bad_request(f"{param}: unknown content part type {kind!r}", f"{param}.type")
    return "".join(texts)


def _sampling_params(body: ChatCompletionRequest, model: ServedModel) -> SamplingParams:
    if body.n not in (None, 1):
        raise bad_request("n > 1 is not supported yet", "n")
    if body.logprobs or body.top_logprobs:
        raise bad_request("logprobs are not supported yet", "logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if value not in (None, 0, 0.0):
            raise bad_request(f"{name} is not supported yet", name)
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    both = body.max_tokens is not None and body.max_completion_tokens is not None
    if both and body.max_tokens != body.max_completion_tokens:
        raise bad_request(
            "max_tokens and max_completion_tokens disagree; send one", "max_completion_tokens"
        )
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    try:
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else 1,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            min_p=body.min_p or 0.0,
            seed=body.seed if body.seed is not None else model.engine_config.seed,
            stop=stop,
            ignore_eos=body.ignore_eos,
        )
    except SamplingParamError as exc:
        param = (
            "max_completion_tokens"
            if exc.param == "max_tokens" and body.max_tokens is None
            else exc.param
        )
        raise bad_request(str(exc), param) from None


def _replace_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, max_tokens=max_tokens)


def _admit(model: ServedModel, num_prompt_tokens: int, params: SamplingParams) -> None:
    try:
        model.engine.check_admission(num_prompt_tokens, params)
    except AdmissionError as exc:
        raise bad_request(str(exc), exc.param, code="context_length_exceeded") from None
    except EngineBusyError as exc:
        raise APIError(503, str(exc), headers={"Retry-After": "1"}) from None
    except EngineStoppedError as exc:
        raise APIError(503, str(exc)) from None


class _Completion:
    """Fields shared by every chunk of one completion."""

    def __init__(self, completion_id: str, created: int, model: str) -> None:
        self.id = completion_id
        self.created = created
        self.model = model

    def envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def _usage(out: RequestOutput) -> dict[str, int]:
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": out.num_output_tokens,
        "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
    }


async def _collect(
    request: Request, completion: _Completion, outputs: AsyncIterator[RequestOutput]
) -> Response:
    """Gather a whole completion, aborting it if the client goes away first."""

    async def gather() -> tuple[str, RequestOutput]:
        parts = []
        last: RequestOutput | None = None
        async for out in outputs:
            parts.append(out.text)
            last = out
        assert last is not None
        return "".join(parts), last

    task = asyncio.ensure_future(gather())
    while not task.done():
        await asyncio.wait({task}, timeout=0.5)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return Response(status_code=499)
    text, last = task.result()
    if last.finish_reason in ("error", "abort"):
        raise APIError(500 if last.finish_reason == "error" else 503, last.error or "aborted")
    body = completion.envelope("chat.completion")
    body["choices"] = [
        {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": last.finish_reason,
            "logprobs": None,
        }
    ]
    body["usage"] = _usage(last)
    return JSONResponse(body)


async def _stream(
    completion: _Completion,
    outputs: AsyncIterator[RequestOutput],
    include_usage: bool,
    keepalive: float,
) -> AsyncIterator[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None) -> bytes:
        body = completion.envelope("chat.completion.chunk")
        body["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
        if include_usage:
            body["usage"] = None
        return sse.event(body)

    yield chunk({"role": "assistant", "content": ""}, None)
    last: RequestOutput | None = None
    async for out in sse.with_heartbeat(outputs, keepalive):
        if out is None:
            yield sse.KEEPALIVE
            continue
        last = out
        if out.finish_reason in ("error", "abort"):
            message = out.error or "the request was aborted"
            yield sse.event(
                {
                    "error": {
                        "message": message,
                        "type": "server_error",
                        "param": None,
                        "code": out.finish_reason,
                    }
                }
            )
            yield sse.DONE
            return
        if out.text:
            yield chunk({"content": out.text}, None)
        if out.finished:
            yield chunk({}, out.finish_reason)
    if last is not None and include_usage:
        body = completion.envelope("chat.completion.chunk")
        body["choices"] = []
        body["usage"] = _usage(last)
        yield sse.event(body)
    yield sse.DONE
