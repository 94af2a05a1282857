"""Messages the engine hands back to callers, one per request per step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Log-probabilities of one generated token, from the model's raw logits.

    ``logprob`` is the sampled token's log-softmax value before penalties, bias or temperature;
    ``top`` holds the requested number of most likely (token id, logprob) pairs, best first.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    text: str  # newly released text since the previous output
    token_ids: tuple[int, ...]  # tokens generated in this step
    finish_reason: str | None  # None while running; "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_output_tokens: int
    stop_reason: str | int | None = None  # matched stop string or stop token id
    error: str | None = None
    # Why an "error" finish is not the engine's fault, when it is not (engine/lora_slots.py's
    # codes: the request's adapter could not be loaded); None otherwise.
    error_code: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token_ids entry, when asked for
    # One per prompt token (None for the first, which nothing predicts), on a request's first
    # output only, when its params ask for prompt_logprobs.
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    # Output tokens spent reasoning so far (params.thinking; 0 without it), markers included.
    reasoning_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class EngineStats:
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    preemptions: int
    prompt_tokens: int
    generated_tokens: int
    steps: int
    last_step_seconds: float
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # prompt tokens found cached
    prefix_cache_entries: int = 0  # cached chains no request holds (engine/kv_cache.py)
    images_encoded: int = 0  # images the encoder ran on (misses of the encoder cache)
    encoder_cache_hits: int = 0  # images whose encoder rows came from the encoder cache
    speculative_drafted: int = 0  # drafted tokens verified (engine/speculative.py)
    speculative_accepted: int = 0  # of those, tokens the model accepted
    lora_resident: int = 0  # LoRA adapters attached now (engine/lora_slots.py)
    lora_loads: int = 0  # adapters loaded into a slot (the first time, or after an eviction)
    lora_evictions: int = 0  # adapters detached to free a slot for another
