"""Engine settings as one frozen dataclass, shared by the CLI, the server and embedders.

Its field defaults are the engine's defaults, the one place they are written: the CLI flags and
the scheduler read them from here."""

from __future__ import annotations

from dataclasses import dataclass

# Where a setting is left unset (None), what the engine derives it from is capped here.
DEFAULT_MAX_MODEL_LEN = 8192  # tokens of context at most, unless --max-seq-len says more
# The KV pool's default (serving/sizing.py): one full context, or this many MiB if that is more,
# within this fraction of the RAM free after the weights; a pool that cannot hold one full
# context lowers the served context to what it holds.
DEFAULT_KV_CACHE_MB = 512
KV_RAM_FRACTION = 0.5
DTYPES = ("auto", "bf16", "f16", "f32")  # compute dtypes; auto: bf16 with native bf16, else f32
# KV cache storage: auto is the compute dtype; int8 is quantized per token and KV head
# (kernels/kv_quant.py), about half of bf16's bytes per token.
KV_CACHE_DTYPES = ("auto", "bf16", "f32", "int8")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    dtype: str = "auto"  # one of DTYPES
    max_num_seqs: int = 16
    max_model_len: int | None = None  # None: the model's context, capped at 8192
    max_num_batched_tokens: int = 512
    max_waiting: int = 256
    block_size: int = 16
    kv_cache_tokens: int | None = None  # None: from kv_cache_mb
    kv_cache_mb: int | None = None  # None: sized from the context and free RAM (sizing.py)
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    # The share of the RAM free after the weights that a pool sized from the context may take
    # (serving/sizing.py); None: KV_RAM_FRACTION. Not with kv_cache_tokens or kv_cache_mb.
    kv_memory_fraction: float | None = None
    seed: int | None = None
    prefix_caching: bool = True
    # Cached prefixes the KV pool keeps (engine/kv_cache.py: an entry is a chain of cached blocks
    # that no request holds; chains sharing a prefix share its blocks), the least recently used
    # forgotten beyond it. None: as many as the pool holds (blocks are reused least recently
    # freed first); 0: prefix caching off.
    prefix_cache_n: int | None = None
    # With decodes running, prompt work (admissions and prefill chunks) waits for at most this
    # many steps of decodes alone (engine/scheduler.py, mistral.rs's rule). None: prompt work
    # joins every step beside the decodes.
    max_decode_steps_before_prefill: int | None = None
    # No KV kept between a request's tokens: each token recomputes the whole sequence, a slow
    # reference path; prefix caching and speculative decoding are off with it.
    no_kv_cache: bool = False
    packed_kernels: bool = True  # int4/int8 weight copies for small batches (bf16; f32 on AVX2)
    isq: str | None = None  # in-situ quantization of each projection: q8 | q4 (loading/quantize.py)
    # An importance matrix file (llama.cpp's GGUF or .dat) ISQ quantizes for (loading/imatrix.py)
    imatrix: str | None = None
    # Bit-identical output for a request and seed whatever else runs: batch-invariant kernels
    # (dense rows, one-query attention for every row; engine/runner.py), at a speed cost.
    deterministic: bool = False
    # Image encoder outputs kept by the image's digest (engine/encoder_cache.py): a repeated
    # image is not encoded again. 256 MB: ~270 SmolVLM-256M images of 13 tiles (832 rows of 576
    # bf16 values each).
    encoder_cache_mb: int = 256
    # Encoder output rows (placeholder tokens of uncached media) one step may compute, so one
    # request with many images cannot stall a step for everyone (engine/encoder_budget.py);
    # None: max_num_batched_tokens. Media larger than it still run, alone in their step.
    max_encoder_tokens: int | None = None
    # Speculative decoding (engine/speculative.py): "ngram" drafts each request's next tokens
    # from its own prompt and output (prompt lookup) where that pays, "off" never drafts.
    speculative: str = "ngram"
    # Drafts verified per step at most; a request starts at 3 and doubles while all are
    # accepted (engine/speculative.py; benchmarks/speculative.py). None: the method's own
    # (speculative.DEFAULT_TOKENS: 31 for a lookup, whose drafts cost nothing to make; 7 for
    # a draft model, which runs once per draft)
    num_speculative_tokens: int | None = None
    # "draft": this model (same tokenizer) drafts; "self": the served model's first
    # self_spec_layers layers (default: half) draft (engine/draft_model.py)
    draft_model: str | None = None
    self_spec_layers: int | None = None
    # LoRA adapters attached to the weights at once (engine/lora_slots.py); more may be served,
    # each loaded on demand into the slot of the least recently used idle one.
    max_loras: int = 4
    # The model's end tokens stop no request (benchmarks: every reply runs to max_tokens).
    disable_eos_stop: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                f"got {self.kv_cache_dtype!r}"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.max_encoder_tokens is not None and self.max_encoder_tokens < 1:
            raise ValueError("max_encoder_tokens must be at least 1")
        if self.encoder_cache_mb < 0:
            raise ValueError("encoder_cache_mb cannot be negative")
        if self.kv_cache_mb is not None and self.kv_cache_mb < 1:
            raise ValueError("kv_cache_mb must be at least 1")
        sizes = (self.kv_cache_tokens, self.kv_cache_mb, self.kv_memory_fraction)
        if sum(size is not None for size in sizes) > 1:
            raise ValueError("give one of kv_cache_tokens, kv_cache_mb and kv_memory_fraction")
        if self.kv_memory_fraction is not None and not 0 < self.kv_memory_fraction <= 0.95:
            raise ValueError("kv_memory_fraction must be above 0 and at most 0.95")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError("kv_cache_tokens must hold at least one block")
        if self.speculative not in ("ngram", "draft", "self", "off"):
            raise ValueError(
                f"speculative must be ngram, draft, self or off, not {self.speculative!r}"
            )
        if (self.draft_model is not None) != (self.speculative == "draft"):
            raise ValueError("speculative=draft and a draft_model go together")
        if self.self_spec_layers is not None and self.speculative != "self":
            raise ValueError("self_spec_layers goes with speculative=self")
        if self.self_spec_layers is not None and self.self_spec_layers < 1:
            raise ValueError("self_spec_layers must be at least 1")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if self.max_loras < 1:
            raise ValueError("max_loras must be at least 1")
        if self.isq not in (None, "q8", "q4"):
            raise ValueError(f"isq must be q8 or q4, not {self.isq!r}")
        if self.imatrix is not None and self.isq is None:
            raise ValueError("an importance matrix (imatrix) goes with in-situ quantization (isq)")
        self._check_cache_options()

    def _check_cache_options(self) -> None:
        """prefix_cache_n, max_decode_steps_before_prefill and no_kv_cache, and the settings
        they contradict."""
        if self.prefix_cache_n is not None and self.prefix_cache_n < 0:
            raise ValueError("prefix_cache_n cannot be negative (0 turns prefix caching off)")
        if self.max_decode_steps_before_prefill is not None and (
            self.max_decode_steps_before_prefill < 1
        ):
            raise ValueError("max_decode_steps_before_prefill must be at least 1")
        if self.prefix_cache_n and not self.prefix_caching:
            raise ValueError(
                f"prefix_cache_n={self.prefix_cache_n} keeps cached prefixes, but prefix "
                "caching is off (prefix_cache_n=0 is the same as prefix_caching off)"
            )
        if self.prefix_cache_n and self.no_kv_cache:
            raise ValueError(
                f"prefix_cache_n={self.prefix_cache_n} keeps cached prefixes, but no_kv_cache "
                "keeps no KV at all"
            )
        if self.no_kv_cache and self.speculative in ("draft", "self"):
            raise ValueError(
                f"speculative={self.speculative} needs the KV cache: no_kv_cache recomputes "
                "every token (use speculative=off)"
            )

    @property
    def caches_prefixes(self) -> bool:
        """Whether the KV pool reuses cached prompt prefixes."""
        return self.prefix_caching and self.prefix_cache_n != 0 and not self.no_kv_cache
