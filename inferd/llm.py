"""``LLM``: offline batch generation, stepped on the caller's thread.

    from inferd import LLM, SamplingParams

    llm = LLM("smollm2", dtype="f32")
    outputs = llm.generate(["The sky is", "Two plus two is"], SamplingParams(max_tokens=16))
    for out in outputs:                      # in input order
        print(out.prompt, out.outputs[0].text, out.outputs[0].finish_reason)
    replies = llm.chat([[{"role": "user", "content": "Name a color."}]])

Every prompt of a call is queued at once; the engine batches them continuously (a finished one
frees its seat for the next) while a progress bar counts finished prompts. There is no server
and no engine thread: the calling thread steps the synchronous ``LLMEngine`` (the main thread,
where PyTorch's intra-op threads pay off; engine/driver.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from inferd.config import EngineConfig
from inferd.engine.driver import CallerLoop
from inferd.engine.llm_engine import LLMEngine
from inferd.engine.outputs import RequestOutput as StepOutput
from inferd.engine.outputs import TokenLogprob
from inferd.engine.request import MediaInput
from inferd.engine.sampling import SamplingParams
from inferd.serving.loading import load_spec
from inferd.serving.multimodal import split_image_parts
from inferd.serving.served import Requantization, ServedModel
from inferd.serving.spec import ModelSpec

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "Usage"]

Prompt = str | Sequence[int]
Conversation = Sequence[Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One generated sequence, complete."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" (end of turn, stop string or stop token) or "length"
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: tuple[TokenLogprob, ...] | None = None  # when SamplingParams.logprobs is set


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A prompt and what was generated for it (vLLM's shape: ``outputs[0].text``)."""

    request_id: str
    prompt: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    finished: bool = True

    @property
    def usage(self) -> Usage:
        return Usage(len(self.prompt_token_ids), sum(len(o.token_ids) for o in self.outputs))


@dataclass(slots=True)
class _Pending:
    """One request's step outputs, accumulated until it finishes."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    last: StepOutput | None = None

    def add(self, out: StepOutput) -> None:
        self.text.append(out.text)
        self.token_ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs or ())
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.last = out


class GenerationError(RuntimeError):
    """The engine failed a request (its message says why); the others were ended too."""


class LLM:
    """One chat model loaded for offline use. ``model``: a store name, a .gguf file, a model
    directory or a Hugging Face cache id, as ``inferd serve -m`` takes. ``options`` are
    ``EngineConfig`` fields (``dtype``, ``max_num_seqs``, ``max_model_len``,
    ``kv_cache_tokens``, ``seed``...); ``chat_template`` replaces the model's own (Jinja);
    ``mmproj``: a llama.cpp multimodal projector for a GGUF model (``--mmproj``)."""

    def __init__(
        self,
        model: str | Path,
        *,
        chat_template: str | None = None,
        progress_bar: bool = False,
        mmproj: str | Path | None = None,
        **options: Any,
    ) -> None:
        spec = ModelSpec(
            model_id=str(model),
            chat_template=chat_template,
            mmproj=str(mmproj) if mmproj is not None else None,
        )
        # The caller steps the engine: nothing runs between calls.
        served = load_spec(spec, EngineConfig(**options), progress=progress_bar, loop=CallerLoop())
        if not isinstance(served, ServedModel):
            served.shutdown()
            raise ValueError(f"{served.id} is an embedding model; LLM needs a chat model")
        self.model = served
        self._ids = itertools.count()

    @property
    def engine(self) -> LLMEngine:
        """The synchronous engine this LLM steps (for stats or finer control)."""
        return self.model.engine.engine

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete each prompt (a string, or token ids); outputs in input order.
        ``sampling_params``: one for all, or one per prompt (default: SamplingParams())."""
        items = _prompt_list(prompts)
        encoded = [
            (p, self.model.tokenizer.encode(p, add_special=True))
            if isinstance(p, str)
            else (self._text(p), [int(t) for t in p])
            for p in items
        ]
        return self._run(encoded, sampling_params, use_tqdm)

    def chat(
        self,
        conversations: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Reply to each conversation (a list of ``{"role", "content"}`` messages) through the
        model's chat template; one conversation alone is taken as a batch of one. A vision
        model takes images as content parts: ``{"type": "image", "image": PIL image}``."""
        batch: Sequence[Conversation]
        if conversations and isinstance(conversations[0], Mapping):
            batch = [conversations]  # type: ignore[list-item]
        else:
            batch = conversations  # type: ignore[assignment]
        encoded = []
        media: list[list[MediaInput]] = []
        for messages in batch:
            plain, images = split_image_parts(messages)
            ids, with_images = self.model.chat_prompt(plain, images)
            encoded.append((self._text(ids), ids))
            media.append(with_images)
        return self._run(encoded, sampling_params, use_tqdm, media)

    def requantize(self, method: str) -> Requantization:
        """Quantize the model's projections again, q8 or q4, from its files (as
        ``--isq``/``isq=`` at load, for its ``imatrix=`` if it had one) and generate with them
        from the next call on; the prefix cache is forgotten (``ServedModel.requantize``)."""
        return self.model.requantize(method)

    def shutdown(self) -> None:
        self.model.shutdown()

    def _text(self, ids: Sequence[int]) -> str:
        """A prompt given as token ids, as text with its control tokens (turn markers) kept."""
        return self.model.tokenizer.decode(list(ids), skip_special=False)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _run(
        self,
        encoded: list[tuple[str, list[int]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        media: Sequence[Sequence[MediaInput]] | None = None,
    ) -> list[RequestOutput]:
        params = _params_list(sampling_params, len(encoded))
        images = media if media is not None else [()] * len(encoded)
        engine = self.engine
        for (_, ids), p in zip(encoded, params, strict=True):
            engine.check_request(len(ids), p)  # refuse the batch before any of it runs
        rids = [f"llm-{next(self._ids)}" for _ in encoded]
        pending = {rid: _Pending() for rid in rids}
        unfinished = set(rids)
        try:
            for rid, (_, ids), p, m in zip(rids, encoded, params, images, strict=True):
                engine.add_request(rid, ids, p, media=m)
            with tqdm(
                total=len(rids), desc="Generating", unit="prompt", disable=not use_tqdm
            ) as bar:
                while unfinished:
                    for out in engine.step():
                        pending[out.request_id].add(out)
                        if out.finished:
                            unfinished.discard(out.request_id)
                            bar.update(1)
        finally:
            for rid in unfinished:  # an exception or Ctrl-C: leave the engine clean
                engine.abort(rid)
        return [
            _result(rid, prompt, ids, pending[rid])
            for rid, (prompt, ids) in zip(rids, encoded, strict=True)
        ]


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # type: ignore[list-item]  # one prompt of token ids
    return items  # type: ignore[return-value]


def _params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"{len(params)} sampling params for {count} prompts")
    return list(params)


def _result(rid: str, prompt: str, ids: list[int], pending: _Pending) -> RequestOutput:
    last = pending.last
    assert last is not None and last.finish_reason is not None
    if last.finish_reason in ("error", "abort"):
        raise GenerationError(last.error or f"the request ended with {last.finish_reason}")
    want_logprobs = last.logprobs is not None
    completion = CompletionOutput(
        index=0,
        text="".join(pending.text),
        token_ids=tuple(pending.token_ids),
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        logprobs=tuple(pending.logprobs) if want_logprobs else None,
    )
    return RequestOutput(rid, prompt, ids, [completion], pending.prompt_logprobs)
