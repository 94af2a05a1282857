"""LLMEngine: the public synchronous engine API.

    engine.add_request("a", prompt_token_ids, SamplingParams(max_tokens=16))
    while engine.has_unfinished():
        for out in engine.step():   # one scheduling step: a prefill chunk or decode per request
            ...

Nothing here starts a thread: whoever holds an ``LLMEngine`` steps it. ``AsyncEngine`` wraps one
for asyncio callers (stepped by a loop owner, engine/driver.py), ``inferd.LLM`` and the
in-process benchmarks step one themselves. Read-only properties give tools the facts they need
(the model module, its config, the KV pool) without reaching into the engine's parts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from inferd.engine.core import EngineCore
from inferd.engine.detokenizer import IncrementalDetokenizer
from inferd.engine.lora_slots import LoraSlots
from inferd.engine.outputs import EngineStats, RequestOutput
from inferd.engine.request import MediaInput, Request
from inferd.engine.sampling import SamplingParams
from inferd.engine.scheduler import SchedulerConfig
from inferd.models.config import AudioConfig, Gemma4AudioConfig, ModelConfig
from inferd.models.llama import LlamaForCausalLM
from inferd.structured.compiler import GrammarCompiler


class AdmissionError(ValueError):
    """A request the engine can never serve (too long for the context or the KV pool)."""

    def __init__(
        self, message: str, param: str | None = None, code: str = "context_length_exceeded"
    ) -> None:
        super().__init__(message)
        self.param = param
        self.code = code  # the API error code it answers with


def _media_error(message: str) -> AdmissionError:
    return AdmissionError(message, "messages", code="invalid_media")


@dataclass(frozen=True, slots=True)
class TextCodec:
    """What the engine needs of a tokenizer to build requests."""

    token_bytes: Callable[[int], bytes]
    special_ids: frozenset[int]
    eos_token_ids: frozenset[int]


class LLMEngine:
    def __init__(
        self,
        core: EngineCore,
        codec: TextCodec,
        grammars: GrammarCompiler | None = None,
        *,
        stop_on_eos: bool = True,
    ) -> None:
        """``grammars``: compiles ``SamplingParams.constraint`` for this model's vocabulary;
        without it, constrained requests are refused. ``stop_on_eos`` False: the model's end
        tokens stop no request (``--disable-eos-stop``: every request as if ``ignore_eos``)."""
        self._core = core
        self.codec = codec
        self.grammars = grammars
        self.stop_on_eos = stop_on_eos

    # -- facts ------------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self._core.max_model_len

    @property
    def model(self) -> LlamaForCausalLM:
        """The model module the steps run (for inspection: its layers and kernels)."""
        return self._core.runner.model

    @property
    def adapters(self) -> LoraSlots:
        """Which LoRA adapters are resident (``--max-loras``); serving/lora.py gives it its
        loader."""
        return self._core.scheduler.adapters

    @property
    def model_config(self) -> ModelConfig:
        return self._core.runner.config

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return self._core.scheduler.config

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the whole KV pool holds: no request may need more."""
        return self._core.scheduler.kv.capacity_tokens

    def encoder_cached(self, digest: str) -> bool:
        """Whether the encoder cache holds the rows of the media with this digest."""
        return digest in self._core.runner.encoder_cache

    @property
    def last_step_seconds(self) -> float:
        return self._core.last_step_seconds

    def room(self, num_prompt_tokens: int) -> int:
        """The most tokens a request with this prompt may generate: what the context and the
        whole KV pool leave after it (0: the prompt itself does not fit). A request that gives
        no max_tokens gets this much."""
        return max(0, min(self.max_model_len, self.kv_capacity_tokens) - num_prompt_tokens)

    # -- requests ---------------------------------------------------------------------------
    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """AdmissionError if a request of this size can never run here."""
        if num_prompt_tokens == 0:
            raise AdmissionError("the prompt is empty after tokenization", "messages")
        limit = self.max_model_len
        needed = num_prompt_tokens + params.max_tokens
        if needed > limit:
            raise AdmissionError(
                f"this model's maximum context length is {limit} tokens, but the request asks for "
                f"{num_prompt_tokens} prompt tokens + {params.max_tokens} max_tokens = "
                f"{needed}; shorten the prompt or lower max_tokens",
                "max_tokens",
            )
        capacity = self.kv_capacity_tokens
        kv = self._core.scheduler.kv
        held = kv.tokens_held(needed, self.scheduler_config.max_num_batched_tokens)
        if held > capacity:
            raise AdmissionError(
                f"the request needs {held} tokens of KV cache but "
                f"the whole pool holds {capacity}; lower max_tokens or raise --kv-cache-tokens",
                "max_tokens",
            )

    def check_media(self, prompt_token_ids: Sequence[int], media: Sequence[MediaInput]) -> None:
        """AdmissionError unless the model has an encoder for each medium's modality and every
        medium sits on placeholder tokens of this prompt, in order and apart, as many as its
        encoder input fills: checked here, a bad medium would fail the whole step it ran in."""
        if not media:
            return
        end = -1
        for m in media:
            placeholder = self.model_config.placeholder_token(m.modality)
            if placeholder is None:
                kind = "images" if m.modality == "image" else m.modality
                raise _media_error(f"{self.model_config.architecture} models take no {kind}")
            if not m.positions or list(m.positions) != sorted(set(m.positions)):
                raise _media_error(f"an {m.modality}'s placeholder positions must ascend")
            if m.positions[0] <= end or m.positions[-1] >= len(prompt_token_ids):
                raise _media_error("media overlap or lie outside the prompt")
            if any(prompt_token_ids[p] != placeholder for p in m.positions):
                raise _media_error(f"an {m.modality}'s rows must replace its placeholder tokens")
            if m.modality == "audio" and self.model_config.gemma4_audio is not None:
                self._check_gemma4_clip(m)
            elif m.modality == "audio" and self.model_config.gemma3n_audio is not None:
                self._check_gemma3n_clip(m)
            elif m.modality == "audio":
                self._check_clip(m)
            elif self.model_config.gemma4_vision is not None:
                self._check_placed_patches(m)
            elif self.model_config.qwen_vision is not None:
                self._check_grid(m)
            elif self.model_config.gemma3n_vision is not None:
                self._check_gemma3n_image(m)
            else:
                self._check_image(m)
            end = m.positions[-1]

    def _check_image(self, m: MediaInput) -> None:
        """An image's tiles have the encoder's size and fill its placeholders exactly."""
        vision = self.model_config.vision
        assert vision is not None  # placeholder_token("image") said so
        side = vision.image_size
        tiles = m.pixel_values.shape[0]
        if tuple(m.pixel_values.shape[1:]) != (vision.num_channels, side, side):
            raise _media_error(f"an image's tiles must be {side}x{side} pixels")
        if tiles * vision.tokens_per_tile != len(m.positions):
            raise _media_error(
                f"an image of {tiles} tiles fills {tiles * vision.tokens_per_tile} "
                f"placeholder tokens, not {len(m.positions)}"
            )
        if vision.bidirectional and m.positions[-1] - m.positions[0] + 1 != len(m.positions):
            raise _media_error("an image's placeholder tokens must be consecutive")

    def _check_gemma3n_image(self, m: MediaInput) -> None:
        """Gemma 3n: one RGB image of at least the encoder's 32-pixel stride fills the model's
        fixed count of image tokens (its fused grid)."""
        vision = self.model_config.gemma3n_vision
        assert vision is not None  # placeholder_token("image") said so
        shape = tuple(m.pixel_values.shape)
        if len(shape) != 4 or shape[:2] != (1, 3) or min(shape[2:]) < 32:
            raise _media_error("an image must be one RGB tile of at least 32x32 pixels")
        if len(m.positions) != vision.soft_tokens:
            raise _media_error(
                f"an image fills {vision.soft_tokens} placeholder tokens, not {len(m.positions)}"
            )

    def _bidirectional_spans(self, media: Sequence[MediaInput]) -> tuple[tuple[int, int], ...]:
        """Each image's (Gemma 4: and video frame's) placeholder range, for a model whose
        image tokens see each other both ways (Gemma 3, Gemma 4); none otherwise."""
        vision, gemma4 = self.model_config.vision, self.model_config.gemma4_vision
        visual: tuple[str, ...]
        if gemma4 is not None and gemma4.bidirectional:
            visual = ("image", "video")
        elif vision is not None and vision.bidirectional:
            visual = ("image",)
        else:
            return ()
        return tuple((m.positions[0], m.positions[-1] + 1) for m in media if m.modality in visual)

    def _check_placed_patches(self, m: MediaInput) -> None:
        """Gemma 4: an image's (a video frame's) patches and their places agree, fill its
        placeholders exactly (one per ``pooling^2`` patches) and lie in the position table;
        its placeholders run unbroken (they see each other both ways)."""
        g = self.model_config.gemma4_vision
        assert g is not None  # placeholder_token said so
        places, n = m.places, int(m.pixel_values.shape[0])
        if (
            places is None
            or tuple(m.pixel_values.shape) != (n, g.patch_dim)
            or tuple(places.shape) != (n, 2)
        ):
            raise _media_error(
                f"an {m.modality}'s patches must be [patches, {g.patch_dim}] with their places"
            )
        if n % g.pooling**2 or n // g.pooling**2 != len(m.positions):
            raise _media_error(
                f"an {m.modality} of {n} patches does not fill {len(m.positions)} placeholder "
                "tokens"
            )
        if n and (int(places.min()) < 0 or int(places.max()) >= g.position_table_size):
            raise _media_error(f"an {m.modality}'s patch places lie outside the position table")
        if m.positions[-1] - m.positions[0] + 1 != len(m.positions):
            raise _media_error(f"an {m.modality}'s placeholder tokens must be consecutive")

    def _check_gemma4_clip(self, m: MediaInput) -> None:
        """Gemma 4: a clip's log-mel frames [frames, mel bins] give one row per placeholder."""
        audio = self.model_config.gemma4_audio
        assert audio is not None
        bins = audio.conv_channels[0]
        if tuple(m.pixel_values.shape) != (m.frames, bins) or m.frames < 1:
            raise _media_error(f"an audio clip's features must be [frames, {bins}]")
        if Gemma4AudioConfig.num_tokens(m.frames) != len(m.positions):
            raise _media_error(
                f"an audio clip of {m.frames} frames has {Gemma4AudioConfig.num_tokens(m.frames)} "
                f"rows, not {len(m.positions)}"
            )

    def _check_gemma3n_clip(self, m: MediaInput) -> None:
        """Gemma 3n: a clip's log-mel frames [frames, mel bins] encode to at most the model's
        count of audio tokens, which its placeholders are (padding fills the rest)."""
        audio = self.model_config.gemma3n_audio
        assert audio is not None
        if tuple(m.pixel_values.shape) != (m.frames, audio.mel_bins) or m.frames < 1:
            raise _media_error(f"an audio clip's features must be [frames, {audio.mel_bins}]")
        rows = audio.num_rows(m.frames)
        if rows > audio.soft_tokens or len(m.positions) != audio.soft_tokens:
            raise _media_error(
                f"an audio clip of {m.frames} frames ({rows} rows) fills {audio.soft_tokens} "
                f"placeholder tokens, not {len(m.positions)}"
            )

    def _check_grid(self, m: MediaInput) -> None:
        """An image's or video's patch grid fills its placeholders, which run unbroken (its
        M-RoPE positions are laid out over them), and its pixels or patches match the grid."""
        q = self.model_config.qwen_vision
        assert q is not None
        unit = q.spatial_merge_size
        if m.grid is None or min(m.grid) < 1 or m.grid[1] % unit or m.grid[2] % unit:
            raise _media_error(f"an {m.modality} needs a patch grid in whole {unit}x{unit} groups")
        t, h, w = m.grid
        if t * h * w // unit**2 != len(m.positions):
            raise _media_error(
                f"an {m.modality} of grid {list(m.grid)} fills {t * h * w // unit**2} "
                f"placeholder tokens, not {len(m.positions)}"
            )
        if m.positions[-1] - m.positions[0] + 1 != len(m.positions):
            raise _media_error(f"an {m.modality}'s placeholder tokens must be consecutive")
        p, frames = q.patch_size, t * q.temporal_patch_size
        pixels = (frames, q.in_channels, h * p, w * p)
        patches = (t * h * w, q.patch_dim)
        if tuple(m.pixel_values.shape) != (patches if m.expand is None else pixels):
            raise _media_error(f"an {m.modality}'s pixels do not match its grid {list(m.grid)}")

    def _check_clip(self, m: MediaInput) -> None:
        """A clip's features fit the encoder's window and give one row per placeholder: the
        runner would otherwise fail mid-step."""
        audio = self.model_config.audio
        assert audio is not None  # placeholder_token("audio") said so
        shape = (1, audio.num_mel_bins, audio.max_frames)
        if tuple(m.pixel_values.shape) != shape or not 0 < m.frames <= audio.max_frames:
            raise _media_error(
                f"an audio clip's features must be {list(shape)} covering 1..{audio.max_frames} "
                "frames"
            )
        if AudioConfig.num_tokens(m.frames) != len(m.positions):
            raise _media_error(
                f"an audio clip of {m.frames} frames has {AudioConfig.num_tokens(m.frames)} rows, "
                f"not {len(m.positions)}"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        media: Sequence[MediaInput] = (),
    ) -> None:
        """Queue a request (checked first); its outputs come from later ``step`` calls.
        ``cache_salt`` keeps its prefix-cache entries private to callers with the same salt;
        ``media``: images whose encoder rows replace placeholder tokens of the prompt."""
        self.check_request(len(prompt_token_ids), params)
        self._core.add(self.build_request(request_id, prompt_token_ids, params, cache_salt, media))

    def build_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        media: Sequence[MediaInput] = (),
    ) -> Request:
        """The engine's record of a request, for ``add_built`` on the stepping thread.

        A constrained request gets its matcher here: from the compile cache when the caller
        compiled the constraint beforehand (``grammars.prepare``), else compiled now (bounded).
        Raises ConstraintError for a constraint that does not compile."""
        self.check_media(prompt_token_ids, media)
        matcher = None
        if params.constraint is not None:
            if self.grammars is None:
                raise AdmissionError("this engine was built without constrained decoding")
            matcher = self.grammars.matcher(params.constraint)
        return Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            eos_token_ids=self.codec.eos_token_ids if self.stop_on_eos else frozenset(),
            cache_salt=cache_salt,
            detokenizer=IncrementalDetokenizer(
                self.codec.token_bytes, self.codec.special_ids, params.stop
            ),
            matcher=matcher,
            media=tuple(media),
            bidirectional_spans=self._bidirectional_spans(media),
        )

    def add_built(self, request: Request) -> None:
        """Queue a request from ``build_request`` (checked by the caller beforehand)."""
        self._core.add(request)

    def step(self) -> list[RequestOutput]:
        """One engine step: each scheduled request's new text and tokens (empty when idle)."""
        return self._core.step()

    def warm_up(self, prompt_token_ids: Sequence[int]) -> None:
        """Run one short greedy request to its end and forget it, before any other: the first
        forward pass pays one-time costs (the kernels' and oneDNN's first calls, the first
        writes into the KV pool; ~0.1 s on SmolLM2 on 2 cores) that would otherwise land on
        the first user's latency. Its prompt is cut short of a block, so nothing of it enters
        the prefix cache, and the counters are put back. An engine too small for it (a
        context or pool of a few tokens) skips it."""
        core, kv = self._core, self._core.scheduler.kv
        counters = (core.steps, core.prompt_tokens, core.generated_tokens, core.last_step_seconds)
        lookups = replace(kv.stats)
        ids = list(prompt_token_ids)[: min(kv.block_size, self.max_model_len) - 2] or [0]
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        try:
            self.add_request("inferd-warm-up", ids, params)
        except AdmissionError:
            return
        while self.has_unfinished():
            self.step()
        core.steps, core.prompt_tokens, core.generated_tokens, core.last_step_seconds = counters
        kv.stats = lookups

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request now and free its KV blocks; None when it is not in flight."""
        return self._core.abort(request_id)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every request with an error output (after a broken step, or at shutdown)."""
        return self._core.fail_all(message)

    def close(self) -> None:
        """Stop the grammar compiler's workers (compilations still queued are cancelled): the
        model is going away."""
        if self.grammars is not None:
            self.grammars.shutdown()

    def swap_weights(self, install: Callable[[LlamaForCausalLM], None]) -> None:
        """Change the model's weights (``install`` does, between two steps) when no request
        has computed anything on the old ones (RuntimeError, nothing changed, while one has);
        then the prefix and encoder caches forget what the old weights computed."""
        started = [
            r for r in self._core.requests.values() if r.num_computed_tokens or r.output_token_ids
        ]
        if started:
            raise RuntimeError(
                f"{len(started)} request(s) already run on the current weights; drain them first"
            )
        install(self.model)
        self._core.scheduler.kv.reset_prefix_cache()
        self._core.runner.encoder_cache.clear()

    def has_unfinished(self) -> bool:
        return self._core.has_work

    @property
    def num_unfinished(self) -> int:
        return len(self._core.requests)

    def stats(self) -> EngineStats:
        core, sched = self._core, self._core.scheduler
        return EngineStats(
            running=len(sched.running),
            waiting=len(sched.waiting),
            kv_blocks_used=sched.kv.pool.num_used,
            kv_blocks_total=sched.kv.pool.num_blocks - 1,
            preemptions=sched.num_preemptions,
            prompt_tokens=core.prompt_tokens,
            generated_tokens=core.generated_tokens,
            steps=core.steps,
            last_step_seconds=core.last_step_seconds,
            prefix_cache_queries=sched.kv.stats.queries,
            prefix_cache_hits=sched.kv.stats.hits,
            prefix_cache_entries=sched.kv.pool.num_entries,
            images_encoded=core.runner.encoder_cache.stats.misses,
            encoder_cache_hits=core.runner.encoder_cache.stats.hits,
            speculative_drafted=sched.speculator.drafted if sched.speculator else 0,
            speculative_accepted=sched.speculator.accepted if sched.speculator else 0,
            lora_resident=len(sched.adapters.resident),
            lora_loads=sched.adapters.loads,
            lora_evictions=sched.adapters.evictions,
        )
