"""Per-request sampling parameters, validated once at construction.

Only what the engine's own code needs is checked here; the limits an HTTP API sets (how many
stop strings, top logprobs, choices) are the server's (inferd/server/api_limits.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from inferd.engine.thinking import ThinkingSpec
from inferd.structured.constraint import Constraint

# Below this temperature sampling is greedy (as in vLLM): dividing logits by a tinier one
# overflows float32 to inf, and softmax over infs is NaN (1e-40 used to pick the last token id).
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # OpenAI penalties: logit -= frequency * count + presence * (count > 0), over output tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # CTRL / HF repetition penalty over prompt and output tokens: positive logits are divided
    # by it, negative ones multiplied. 1.0 disables it.
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    # None: no logprobs. k >= 0: the sampled token's logprob plus the k most likely tokens.
    logprobs: int | None = None
    # None: no prompt logprobs. k >= 0: each prompt token's logprob (None for the first, which
    # nothing predicts) plus the k most likely tokens at its position, on the first output.
    prompt_logprobs: int | None = None
    # What the output must match (a JSON schema, regex, choice or grammar): every token is
    # sampled from those the constraint allows (inferd/structured). None: free text.
    constraint: Constraint | None = None
    # A reasoning model's think block: counted, and closed by the engine at its budget
    # (engine/thinking.py). None: the output is not followed.
    thinking: ThinkingSpec | None = None
    # The LoRA adapter (by name) this request runs with; None: the base model. Its rows get the
    # adapter's updates (layers/lora.py) and its prefix-cache entries are the adapter's own.
    lora: str | None = None

    def __post_init__(self) -> None:
        _check(self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        _check(
            0.0 <= self.temperature <= 2.0,
            "temperature",
            f"must be between 0 and 2, got {self.temperature}",
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"must be 0 (off) or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be between 0 and 1, got {self.min_p}")
        _check(all(self.stop), "stop", "stop strings must not be empty")
        if self.seed is not None:
            _check(0 <= self.seed < 2**63, "seed", "must be a non-negative 64-bit integer")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, f"must be between -2 and 2, got {value}")
        _check(
            0.0 < self.repetition_penalty <= 10.0,
            "repetition_penalty",
            f"must be in (0, 10], got {self.repetition_penalty}",
        )
        for token, bias in self.logit_bias:
            _check(token >= 0, "logit_bias", f"token id {token} is negative")
            _check(
                math.isfinite(bias) and -100.0 <= bias <= 100.0,
                "logit_bias",
                f"the bias of token {token} must be between -100 and 100, got {bias}",
            )
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            _check(k is None or k >= 0, name, f"must be 0 or more, got {k}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def transforms_logits(self) -> bool:
        """Whether the sampler must change this request's logits before choosing a token."""
        return self.has_penalties or bool(self.logit_bias)


class SamplingParamError(ValueError):
    """A sampling parameter out of range; ``param`` names it for the API error envelope."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise SamplingParamError(param, message)
