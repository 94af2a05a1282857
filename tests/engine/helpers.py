"""Shared builders for engine unit tests (no model needed)."""

from __future__ import annotations

from inferd.engine.detokenizer import IncrementalDetokenizer
from inferd.engine.request import Request
from inferd.engine.sampling import SamplingParams


def make_request(
    rid: str,
    prompt_len: int,
    max_tokens: int = 8,
    *,
    prompt: list[int] | None = None,
    cache_salt: str | None = None,
) -> Request:
    """A request whose prompt is unique to its id unless ``prompt`` is given."""
    base = 1000 * (sum(map(ord, rid)) + 1)
    return Request(
        request_id=rid,
        prompt_token_ids=prompt if prompt is not None else [base + i for i in range(prompt_len)],
        params=SamplingParams(max_tokens=max_tokens),
        eos_token_ids=frozenset(),
        detokenizer=IncrementalDetokenizer(lambda t: b"x"),
        cache_salt=cache_salt,
    )
