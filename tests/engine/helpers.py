"""Shared builders for engine unit tests (no model needed)."""

from __future__ import annotations

from inferd.engine.detokenizer import IncrementalDetokenizer
from inferd.engine.request import Request
from inferd.engine.sampling import SamplingParams


def make_request(rid: str, prompt_len: int, max_tokens: int = 8, **params: object) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(prompt_len)),
        params=SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        eos_token_ids=frozenset(),
        detokenizer=IncrementalDetokenizer(lambda t: b"x"),
    )
