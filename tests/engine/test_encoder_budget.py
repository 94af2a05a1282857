"""The scheduler's encoder budget (engine/encoder_budget.py), on requests with media but no
model: the runner's part (encoding what a chunk holds and keeping it) is played by putting the
scheduled media in the encoder cache, as the runner does."""

from __future__ import annotations

import torch

from inferd.engine.encoder_cache import EncoderCache
from inferd.engine.kv_cache import KVCacheManager
from inferd.engine.request import MediaInput, Request
from inferd.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tests.engine.helpers import make_request


def scheduler(encoder_tokens: int, budget: int = 64, seqs: int = 4) -> Scheduler:
    kv = KVCacheManager(256, 4, prefix_caching=False)
    config = SchedulerConfig(seqs, budget, max_encoder_tokens=encoder_tokens)
    return Scheduler(config, kv, EncoderCache(1 << 20))


def media(digest: str, first: int, rows: int) -> MediaInput:
    return MediaInput(digest, tuple(range(first, first + rows)), torch.zeros(1, 3, 1, 1))


def with_media(rid: str, prompt_len: int, *items: MediaInput) -> Request:
    request = make_request(rid, prompt_len, max_tokens=2)
    request.media = items
    return request


def step(s: Scheduler) -> tuple[SchedulerOutput, list[str]]:
    """One step; returns it and the digests it encoded (kept, as the runner keeps them)."""
    out = s.schedule()
    cache = s.encoder_cache
    assert cache is not None
    encoded = []
    for chunk in out.chunks:
        for m in chunk.request.media:
            if m.overlaps(chunk.start, chunk.start + chunk.num_tokens) and m.digest not in cache:
                cache.put(m.digest, torch.zeros(len(m.positions), 1))
                encoded.append(m.digest)
    s.advance(out)
    for chunk in out.chunks:
        if chunk.completes:
            chunk.request.output_token_ids.append(7)
    return out, encoded


def test_media_past_the_budget_wait_for_the_next_step() -> None:
    s = scheduler(encoder_tokens=8)
    request = with_media("a", 30, media("x", 2, 4), media("y", 10, 4), media("z", 20, 4))
    s.add(request)
    out, encoded = step(s)
    assert encoded == ["x", "y"]  # 8 rows: z would make 12
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(0, 20)]  # stops before z
    out, encoded = step(s)
    assert encoded == ["z"] and [(c.start, c.num_tokens) for c in out.chunks] == [(20, 10)]


def test_cached_media_cost_nothing() -> None:
    s = scheduler(encoder_tokens=8)
    cache = s.encoder_cache
    assert cache is not None
    for digest in "xy":
        cache.put(digest, torch.zeros(4, 1))
    s.add(with_media("a", 30, media("x", 2, 4), media("y", 10, 4), media("z", 20, 4)))
    out, encoded = step(s)
    assert encoded == ["z"] and out.chunks[0].num_tokens == 30


def test_media_larger_than_the_budget_run_alone() -> None:
    s = scheduler(encoder_tokens=8)
    big = with_media("big", 30, media("big", 4, 20))
    small = with_media("small", 10, media("small", 2, 4))
    text = make_request("text", 6)
    for request in (big, small, text):
        s.add(request)
    out, encoded = step(s)
    assert encoded == ["big"]  # alone in its step: no deadlock, and nothing beside it
    assert {c.request.request_id for c in out.chunks} == {"big", "text"}  # text still runs
    out, encoded = step(s)
    assert encoded == ["small"]
    while s.has_work:  # both finish
        out, _ = step(s)
        for chunk in out.chunks:
            if chunk.request.output_token_ids:
                s.finish(chunk.request, chunk.request.status)
    assert not s.running


def test_the_same_image_twice_in_one_step_is_charged_once() -> None:
    s = scheduler(encoder_tokens=8)
    s.add(with_media("a", 12, media("x", 2, 8)))
    s.add(with_media("b", 12, media("x", 2, 8)))
    out, encoded = step(s)
    assert encoded == ["x"] and len(out.chunks) == 2


def test_a_request_cut_by_the_budget_keeps_its_turn() -> None:
    s = scheduler(encoder_tokens=8)
    first = with_media("first", 20, media("f1", 0, 6), media("f2", 8, 6))
    later = with_media("later", 10, media("l", 2, 2))  # fits the 2 rows left, yet waits
    s.add(first)
    s.add(later)
    out, encoded = step(s)
    assert encoded == ["f1"]
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("first", 8)]
    out, encoded = step(s)
    assert encoded == ["f2", "l"]  # first's media went first, then the budget holds both
