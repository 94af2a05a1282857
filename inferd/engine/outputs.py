"""Messages the engine hands back to callers, one per request per step."""

from __future__ import annotations

from dataclasses import dataclass


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
