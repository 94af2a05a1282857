"""Per-request sampling parameters, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass

MAX_STOP_STRINGS = 4


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
        _check(
            len(self.stop) <= MAX_STOP_STRINGS,
            "stop",
            f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}",
        )
        _check(all(self.stop), "stop", "stop strings must not be empty")
        if self.seed is not None:
            _check(0 <= self.seed < 2**63, "seed", "must be a non-negative 64-bit integer")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class SamplingParamError(ValueError):
    """A sampling parameter out of range; ``param`` names it for the API error envelope."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise SamplingParamError(param, message)
