"""A loaded model and the engine around it (KV cache, scheduler, runner): what the server
answers for. ``load_model`` takes a source through ``loading.model.load`` and ``assemble``s the
engine, sizing the KV cache from the engine config and the memory the machine has."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from inferd import kernels
from inferd.config import EngineConfig
from inferd.engine.async_engine import AsyncEngine, TextCodec
from inferd.engine.core import EngineCore
from inferd.engine.draft_model import AssistantDrafter
from inferd.engine.driver import EngineLoop, ThreadLoop
from inferd.engine.kv_cache import KVCacheManager
from inferd.engine.llm_engine import LLMEngine
from inferd.engine.lora_slots import LoraSlots
from inferd.engine.runner import ModelRunner
from inferd.engine.sampling import SamplingParams
from inferd.engine.scheduler import Scheduler, SchedulerConfig
from inferd.engine.speculative import speculator_for
from inferd.host_memory import available_bytes
from inferd.kernels.kv_quant import cache_dtype, dtype_name
from inferd.layers.linear import resident_bytes
from inferd.layers.rotary import RotaryEmbedding
from inferd.loading.chat_template import ChatTemplate, RenderedChat, literal_text
from inferd.loading.imatrix import Imatrix
from inferd.loading.imatrix_file import read_imatrix
from inferd.loading.lora import DEFAULT_MAX_LORA_RANK
from inferd.loading.model import LoadedModel, load
from inferd.loading.quantize import Isq, QuantizeError, isq_kind
from inferd.loading.requantize import Requantized, prepare
from inferd.loading.tokenizer import TokenizerBundle
from inferd.media.video import FrameSampling
from inferd.models.config import ModelConfig
from inferd.serving.calibration import Calibration
from inferd.serving.draft import cover, drafter_for, weight_bytes
from inferd.serving.prompter import MediaItem, Prompt, Prompter, prompter_for
from inferd.serving.sizing import Sizing, decide, kv_shape
from inferd.source import ModelSource
from inferd.structured.compiler import GrammarCompiler
from inferd.structured.tool_syntax import ToolFormat, choose
from inferd.structured.vocabulary import Vocabulary

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ServedModel:
    """A loaded model and everything the server needs to answer for it."""

    kind: ClassVar[str] = "chat"  # generates text; EmbeddingModel's kind is "embedding"

    source: ModelSource
    config: ModelConfig
    dtype: torch.dtype
    tokenizer: TokenizerBundle
    chat_template: ChatTemplate
    engine: AsyncEngine
    engine_config: EngineConfig
    kv_cache_tokens: int
    created: int
    prompter: Prompter  # how its prompts take media, chosen for the model (serving/prompter.py)
    kv_cache_dtype: str = ""  # how the pool stores K/V: bf16, f32, int8 (--kv-cache-dtype)
    sizing: Sizing | None = None  # how the context and the pool were decided (startup line)
    weight_bytes: int = 0  # the RAM its weights take (packed copies included)
    isq: str | None = None  # in-situ quantization method (q8 | q4), when asked for (--isq)
    imatrix: Imatrix | None = None  # the importance matrix ISQ quantized for (--imatrix)
    calibration: Calibration | None = None  # the last one started (serving/calibration.py)
    projector: Path | None = None  # the --mmproj file its encoders came from (requantize reads it)
    # How tools reach the prompt and how calls are read (the template's, or --tool-call-parser).
    tool_format: ToolFormat = field(default_factory=ToolFormat)
    # A LoRA adapter's view of a base model (``with_adapter``): its requests run with adapter
    # ``lora`` on the base's engine; ``parent`` is the base's id.
    lora: str | None = None
    parent: str | None = None
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK  # --max-lora-rank: adapters loaded at runtime too

    @property
    def id(self) -> str:
        return self.source.name

    @property
    def modalities(self) -> dict[str, list[str]]:
        """What it takes and gives (server/media.py ``model_modalities`` reads it)."""
        return {"input": list(self.prompter.modalities), "output": ["text"]}

    @property
    def audio_sample_rate(self) -> int | None:
        """The rate this model's audio features are computed at (decoders may resample to it
        once, ``decode_request_media(audio_rate=...)``); None for a model without audio."""
        return self.prompter.audio_sample_rate

    @property
    def video_sampling(self) -> FrameSampling | None:
        """Which frames of a video this model's processor keeps (the decoder samples them,
        ``decode_request_media(video_sampling=...)``); None for a model without video."""
        return self.prompter.video_sampling

    def image_tokens(self, width: int, height: int) -> int | None:
        """The prompt tokens an image of this size costs on this model, upright or turned a
        quarter (its EXIF orientation is not read from the header), whichever is fewer: a
        lower bound known before decoding. None when the model takes no images.
        MediaPromptError for a size its processor refuses."""
        return self.prompter.image_tokens(width, height)

    def prompt(
        self,
        text: str,
        media: Sequence[MediaItem] = (),
        *,
        literal_spans: Sequence[tuple[int, int]] = (),
    ) -> Prompt:
        """Token ids of rendered prompt text whose markers (one per item of ``media``, in
        order; none inside ``literal_spans``) stand for ``media``: decoded images (RGB,
        digest), audio clips (``DecodedAudio``, any rate and channels) or videos; and the media
        to submit with them: ``engine.submit(ids, params, media=media)``. MediaPromptError when
        they disagree or the model does not take one (serving/prompter.py says which)."""
        return Prompt(*self.prompter.prepare(text, media, literal_spans=literal_spans))

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        media: Sequence[MediaItem] = (),
        *,
        special_in_content: bool = False,
    ) -> Prompt:
        """``prompt`` for a conversation, ready for the assistant's turn; its rendered text
        carries one marker per item of ``media`` (the template writes them for its media
        parts)."""
        rendered = self.render_chat(messages, special_in_content=special_in_content)
        return self.prompt(rendered.text, media, literal_spans=rendered.literal_spans)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        prefill: str = "",
        special_in_content: bool = False,
        tools: list[dict[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> RenderedChat:
        """The prompt text, then ``prefill`` (the start of the reply). Special-token text in the
        messages, the tools or the prefill stays plain text (only the template makes control
        tokens) unless ``special_in_content``. ``tools``: the template's ``tools`` variable;
        ``variables``: more template variables (``enable_thinking``, ...). A
        multimodal model's template gets every content as a list of parts (text as ``{"type":
        "text", "text": ...}``): SmolVLM's iterates the parts of each message and would drop
        plain string content without a word."""
        special = None if special_in_content else self.tokenizer.special_token_pattern
        if self.prompter.parts_content:
            messages = [_content_as_parts(m) for m in messages]
        rendered = self.chat_template.render_chat(
            messages,
            special=special,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            variables=variables,
        )
        return rendered + literal_text(prefill, special) if prefill else rendered

    def with_adapter(self, name: str, key: str) -> ServedModel:
        """This model served as ``name``, every request with the LoRA adapter ``key`` (already
        attached to the decoder: serving/lora.py), on the same engine."""
        source = dataclasses.replace(self.source, name=name)
        prompter = dataclasses.replace(self.prompter, model=name)  # its refusals name the view
        return dataclasses.replace(self, source=source, prompter=prompter, lora=key, parent=self.id)

    def adapted(self, params: SamplingParams) -> SamplingParams:
        """``params`` with this view's adapter (unchanged for a base model)."""
        return params if self.lora is None else dataclasses.replace(params, lora=self.lora)

    def requantize(self, method: str, imatrix: Imatrix | None = None) -> Requantization:
        """Quantize every projection again with ``method`` (q8 | q4) from the model's files, as
        a load under ``--isq METHOD`` would (loading/requantize.py), for ``imatrix`` (by
        default the matrix the model was quantized for, if any: ``--imatrix``, a calibration
        applied), and serve from the new weights. Blocks (off the event loop); refused
        (RuntimeError, nothing changed) while a request runs on the current weights: drain
        first (``ModelSlot.requantize`` does)."""
        return self.swap_weights(self.prepare_requantize(method, imatrix)).result()

    def prepare_requantize(self, method: str, imatrix: Imatrix | None = None) -> Requantized:
        """The new weights of ``requantize``, made while the model serves on (it is not
        touched). QuantizeError for an unknown method, an adapter's view, or a matrix made for
        another model."""
        isq_kind(method)
        if self.lora is not None:
            raise QuantizeError(
                f"{self.id!r} is a LoRA adapter on {self.parent!r}; re-quantize {self.parent!r}"
            )
        isq = Isq(method, imatrix=self.imatrix if imatrix is None else imatrix)
        return prepare(self.engine.engine.model, self.source, isq, self.projector)

    def swap_weights(self, new: Requantized) -> Future[Requantization]:
        """Serve from ``new`` from the next engine step on, the prefix cache forgotten
        (``LLMEngine.swap_weights``, between two steps)."""

        def swap(engine: LLMEngine) -> Requantization:
            previous, before = self.isq, self.weight_bytes
            engine.swap_weights(new.install)
            self.isq, self.weight_bytes = new.isq.method, resident_bytes(engine.model)
            self.imatrix = new.isq.imatrix
            log.info(
                "%s re-quantized (isq %s -> %s%s): weights %.0f -> %.0f MiB, prefix cache cleared",
                self.id,
                previous or "none",
                self.isq,
                f", imatrix sha256:{self.imatrix.digest()[:16]}" if self.imatrix else "",
                before / 2**20,
                self.weight_bytes / 2**20,
            )
            return Requantization(previous, self.isq, before, self.weight_bytes)

        return self.engine.between_steps(swap)

    def shutdown(self) -> None:
        if self.lora is not None:
            return  # an adapter's view: the base model's slot owns the engine
        self.engine.shutdown()


@dataclass(frozen=True, slots=True)
class Requantization:
    """What ``ServedModel.requantize`` changed: the ISQ method, and the RAM the weights take."""

    previous: str | None
    method: str
    weight_bytes_before: int
    weight_bytes: int


def load_model(
    source: ModelSource | str | Path,
    cfg: EngineConfig,
    *,
    progress: bool = True,
    chat_template: str | None = None,
    loop: EngineLoop | None = None,
    tool_call_parser: str | None = None,
    mmproj: str | Path | None = None,
    config_overrides: Mapping[str, Any] | None = None,
    matformer: tuple[str, str] | None = None,
) -> ServedModel:
    """A .gguf file, or a Hugging Face directory (``loading.model.load``).

    ``chat_template``: Jinja source that replaces the model's own template. ``loop``: who steps
    the engine (engine/driver.py); by default a thread of its own. ``tool_call_parser``: the
    tool-call syntax (structured/tool_syntax), when not the one the template shows. ``mmproj``:
    a llama.cpp multimodal projector for a GGUF language model (loading/projector.py).
    ``config_overrides``: merged into a Hugging Face directory's config.json. ``matformer``:
    (slice table, slice name) of a Gemma 3n MatFormer slice (loading/matformer.py)."""
    started = time.perf_counter()
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)
    loaded = load(
        source,
        dtype=cfg.dtype,
        isq=cfg.isq,
        imatrix=read_imatrix(cfg.imatrix) if cfg.imatrix is not None else None,
        packed_kernels=cfg.packed_kernels,
        progress=progress,
        chat_template=chat_template,
        mmproj=mmproj,
        config_overrides=config_overrides,
        matformer=matformer,
    )
    served = assemble(loaded, cfg, loop=loop, tool_call_parser=tool_call_parser)
    log.info("loaded %s in %.1fs", served.source.name, time.perf_counter() - started)
    return served


def assemble(
    loaded: LoadedModel,
    cfg: EngineConfig,
    loop: EngineLoop | None = None,
    tool_call_parser: str | None = None,
) -> ServedModel:
    """The engine (KV cache, scheduler, runner) around a loaded model, as a ServedModel.
    ``loop``: who steps the engine; by default a thread of its own."""
    source, model, mcfg, dtype = loaded.source, loaded.model, loaded.config, loaded.dtype
    tokenizer, template, stop_ids, isq = (
        loaded.tokenizer,
        loaded.chat_template,
        loaded.stop_ids,
        loaded.isq,
    )
    # The weights are in: what RAM is free now, less the draft model's weights (loaded next),
    # is what the KV pool may take a part of.
    free = available_bytes()
    drafter = drafter_for(loaded, cfg)
    draft_bytes = weight_bytes(drafter, loaded)
    kv_dtype = cache_dtype(cfg.kv_cache_dtype, dtype)
    sizing = decide(
        kv_shape(mcfg, kv_dtype.itemsize, cache_dtype=dtype_name(kv_dtype)),
        available_bytes=free,
        draft_bytes=draft_bytes,
        max_seq_len=cfg.max_model_len,
        kv_cache_tokens=cfg.kv_cache_tokens,
        kv_cache_mb=cfg.kv_cache_mb,
        memory_fraction=cfg.kv_memory_fraction,
        block_size=cfg.block_size,
        window=mcfg.uniform_window,
        chunk=cfg.max_num_batched_tokens,
    )
    if sizing.lowered_from is not None:
        log.warning("%s: %s", source.name, sizing.reason)
    max_len = sizing.max_seq_len
    for module in model.modules():  # rope scaling may allow positions past the trained ones
        if isinstance(module, RotaryEmbedding):
            module.cover(max_len)
    if drafter is not None:
        cover(drafter, max_len)
    model.use_kernels(kernels.load_ops(dtype))  # built now (once per machine), not mid-request
    num_blocks = sizing.pool_tokens // cfg.block_size + 1  # +1: the reserved null block
    runner = ModelRunner(
        model,
        mcfg,
        num_blocks,
        cfg.block_size,
        kv_dtype,
        deterministic=cfg.deterministic,
        encoder_cache_bytes=cfg.encoder_cache_mb << 20,
    )
    scheduler = Scheduler(
        SchedulerConfig(
            cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
            cfg.max_waiting,
            cfg.max_encoder_tokens,
            max_decode_steps_before_prefill=cfg.max_decode_steps_before_prefill,
            no_kv_cache=cfg.no_kv_cache,
        ),
        KVCacheManager(
            num_blocks,
            cfg.block_size,
            prefix_caching=cfg.caches_prefixes,
            max_prefix_entries=cfg.prefix_cache_n,
            model_key=source.digest,
            window=mcfg.uniform_window,
        ),
        runner.encoder_cache,
        speculator_for(cfg, drafter),
        LoraSlots(cfg.max_loras),
    )
    if isinstance(drafter, AssistantDrafter) or (drafter is not None and drafter.model is model):
        # Self-drafting: its layers' keys and values are the served model's own; Gemma 4's
        # assistant reads them, and starts from the served model's hidden states.
        drafter.share(scheduler.kv, runner.kv_caches)
        runner.keep_hidden = isinstance(drafter, AssistantDrafter)
    stops = [tokenizer.tokenizer.token_to_id(t) for t in template.end_of_turn_tokens()]
    eos = {i for i in [tokenizer.eos_token_id, *stops, *stop_ids] if i is not None}
    codec = TextCodec(tokenizer.id_to_bytes, tokenizer.special_ids, frozenset(eos))
    # The grammar vocabulary is built on the first constrained request, not at load time.
    grammars = GrammarCompiler(Vocabulary.of(tokenizer.tokenizer.to_str, mcfg.vocab_size, eos))
    stepper = LLMEngine(
        EngineCore(runner, scheduler, max_len),
        codec,
        grammars,
        stop_on_eos=not cfg.disable_eos_stop,
    )
    stepper.warm_up(tokenizer.encode("Hello.", add_special=True))
    engine = AsyncEngine(stepper, loop or ThreadLoop())
    return ServedModel(
        source=source,
        config=mcfg,
        dtype=dtype,
        tokenizer=tokenizer,
        chat_template=template,
        engine=engine,
        engine_config=cfg,
        kv_cache_tokens=(num_blocks - 1) * cfg.block_size,
        kv_cache_dtype=dtype_name(kv_dtype),
        created=int(time.time()),
        prompter=prompter_for(loaded),
        sizing=sizing,
        weight_bytes=resident_bytes(model),
        isq=isq.method if isq is not None else None,
        imatrix=isq.imatrix if isq is not None else None,
        projector=loaded.projector,
        tool_format=choose("" if template.missing else template.source, tool_call_parser),
    )


def _content_as_parts(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if not isinstance(content, str):
        return message
    return {**message, "content": [{"type": "text", "text": content}]}
