"""Prefix caching in the block pool: hits, sharing, salts, eviction order."""

from __future__ import annotations

from dataclasses import replace

from inferd.engine.kv_cache import KVCacheManager
from inferd.engine.request import RequestStatus
from inferd.engine.scheduler import Scheduler, SchedulerConfig
from tests.engine.helpers import make_request

BS = 4
PROMPT = list(range(100, 140))  # 40 tokens = 10 full blocks


def _scheduler(blocks: int = 64, prefix: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(8, 256), KVCacheManager(blocks, BS, prefix_caching=prefix))


def _prefill(s: Scheduler) -> None:
    out = s.schedule()
    s.advance(out)


def test_second_request_reuses_the_cached_prefix_and_shares_blocks() -> None:
    s = _scheduler()
    a = make_request("a", 0, prompt=PROMPT)
    s.add(a)
    _prefill(s)
    b = make_request("b", 0, prompt=[*PROMPT[:30], 7, 8, 9])  # diverges inside block 7
    s.add(b)
    out = s.schedule()
    (chunk,) = out.chunks
    assert chunk.request is b and chunk.start == 28  # 7 full blocks match
    assert b.block_ids[:7] == a.block_ids[:7]
    assert all(s.kv.pool.ref_count(i) == 2 for i in a.block_ids[:7])
    assert s.kv.stats.hits == 28 and s.kv.stats.queries == 40 + 33


def test_the_last_prompt_token_is_always_recomputed() -> None:
    s = _scheduler()
    s.add(make_request("a", 0, prompt=PROMPT[:8]))
    _prefill(s)
    b = make_request("b", 0, prompt=PROMPT[:8])  # identical, exactly two blocks
    s.add(b)
    (chunk,) = s.schedule().chunks
    assert chunk.start == 4 and chunk.num_tokens == 4  # one block reused, the second recomputed


def test_cache_salt_isolates_tenants() -> None:
    s = _scheduler()
    s.add(make_request("a", 0, prompt=PROMPT, cache_salt="tenant-1"))
    _prefill(s)
    other = make_request("b", 0, prompt=PROMPT, cache_salt="tenant-2")
    same = make_request("c", 0, prompt=PROMPT, cache_salt="tenant-1")
    s.add(other)
    s.add(same)
    starts = {c.request.request_id: c.start for c in s.schedule().chunks}
    assert starts == {"b": 0, "c": 36}


def test_freed_blocks_stay_findable_until_reused_least_recent_first() -> None:
    s = _scheduler(blocks=1 + 20)
    a = make_request("a", 0, prompt=PROMPT)  # 10 blocks
    s.add(a)
    _prefill(s)
    a_blocks = list(a.block_ids)
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    assert s.kv.pool.num_used == 0 and s.kv.pool.num_cached == 10
    # A stranger takes 12 blocks: the 10 never-used ones first, then a's tail (freed first).
    x = make_request("x", 48)
    s.add(x)
    _prefill(s)
    s.finish(x, RequestStatus.FINISHED_STOPPED)
    b = make_request("b", 0, prompt=PROMPT)
    s.add(b)
    (chunk,) = s.schedule().chunks
    assert chunk.start == 8 * BS  # blocks 9 and 10 of a were evicted, the first 8 survived
    assert b.block_ids[:8] == a_blocks[:8]


def test_prefix_caching_off_never_hits() -> None:
    s = _scheduler(prefix=False)
    for rid in ("a", "b"):
        s.add(make_request(rid, 0, prompt=PROMPT))
        _prefill(s)
    assert s.kv.stats.hits == 0 and s.kv.pool.num_cached == 0


def test_a_request_asking_for_prompt_logprobs_attaches_no_cached_prefix() -> None:
    s = _scheduler()
    s.add(make_request("a", 0, prompt=PROMPT))
    _prefill(s)
    scorer = make_request("b", 0, prompt=PROMPT)
    scorer.params = replace(scorer.params, prompt_logprobs=0)
    s.add(scorer)
    queries, hits = s.kv.stats.queries, s.kv.stats.hits
    (chunk,) = s.schedule().chunks
    assert chunk.request is scorer and chunk.start == 0 and chunk.num_tokens == len(PROMPT)
    assert (s.kv.stats.queries, s.kv.stats.hits) == (queries, hits)


def test_a_reset_forgets_every_prefix_and_keeps_the_blocks() -> None:
    """After new weights (POST /re_isq), no block computed with the old ones is found again;
    the blocks themselves and who holds them are unchanged, and caching starts over."""
    s = _scheduler()
    a = make_request("a", 0, prompt=PROMPT)
    s.add(a)
    _prefill(s)
    held = list(a.block_ids)
    s.kv.reset_prefix_cache()
    assert s.kv.pool.num_cached == 0
    assert a.block_ids == held and all(s.kv.pool.ref_count(i) == 1 for i in held)
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    b = make_request("b", 0, prompt=PROMPT)
    s.add(b)
    out = s.schedule()
    (chunk,) = out.chunks
    assert chunk.start == 0  # computed again, from the first token
    s.advance(out)
    c = make_request("c", 0, prompt=PROMPT)
    s.add(c)
    (chunk,) = s.schedule().chunks
    assert chunk.start == 36  # what the new weights computed is cached again
