"""Prefix caching in the block pool: hits, sharing, salts, eviction order, entries kept."""

from __future__ import annotations

from dataclasses import replace

from inferd.engine.kv_cache import KVCacheManager
from inferd.engine.request import Request, RequestStatus
from inferd.engine.scheduler import Scheduler, SchedulerConfig
from tests.engine.helpers import make_request

BS = 4
PROMPT = list(range(100, 140))  # 40 tokens = 10 full blocks


def _scheduler(blocks: int = 64, prefix: bool = True, entries: int | None = None) -> Scheduler:
    kv = KVCacheManager(blocks, BS, prefix_caching=prefix, max_prefix_entries=entries)
    return Scheduler(SchedulerConfig(8, 256), kv)


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
    assert s.kv.pool.num_entries == 2  # x's chain, and a's, two blocks shorter
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


def _serve(s: Scheduler, rid: str, prompt: list[int]) -> Request:
    """Prefill a request and finish it: it leaves its chain behind. Returns it (its
    ``block_hashes`` name its blocks' content)."""
    request = make_request(rid, 0, prompt=prompt)
    s.add(request)
    _prefill(s)
    s.finish(request, RequestStatus.FINISHED_STOPPED)
    return request


def _cached_blocks(s: Scheduler, request: Request) -> int:
    """How many of the request's leading blocks are still findable."""
    found = 0
    while found < len(request.block_hashes) and s.kv.pool.lookup(request.block_hashes[found]):
        found += 1
    return found


def test_an_entry_is_a_chain_left_behind_and_the_same_chain_counts_once() -> None:
    s = _scheduler()
    _serve(s, "a", PROMPT)
    assert s.kv.pool.num_entries == 1
    _serve(s, "b", PROMPT)  # the same chain again (its last block recomputed, not cached twice)
    assert s.kv.pool.num_entries == 1
    _serve(s, "c", [*PROMPT[:28], 1, 2, 3, 4, 5, 6, 7, 8])  # shares 7 blocks, then its own
    assert s.kv.pool.num_entries == 2
    running = make_request("d", 0, prompt=[*PROMPT, 1, 2, 3, 4, 5])
    s.add(running)
    _prefill(s)  # it holds a's whole chain and goes on: no entry of a's while it runs
    assert s.kv.pool.num_entries == 1
    s.finish(running, RequestStatus.FINISHED_STOPPED)
    assert s.kv.pool.num_entries == 2


def test_the_least_recently_used_entry_beyond_the_limit_is_forgotten() -> None:
    s = _scheduler(entries=2)
    x = _serve(s, "x", PROMPT)
    y = _serve(s, "y", [p + 100 for p in PROMPT])
    _serve(s, "x2", PROMPT)  # leaves x's chain again: x is the most recently used now
    z = _serve(s, "z", [p + 200 for p in PROMPT])
    assert s.kv.pool.num_entries == 2
    assert _cached_blocks(s, y) == 0  # y was the least recently used: every block forgotten
    assert _cached_blocks(s, x) == _cached_blocks(s, z) == 10
    assert s.kv.pool.num_cached == 20 and s.kv.pool.num_used == 0
    again = make_request("y2", 0, prompt=y.prompt_token_ids)
    s.add(again)
    (chunk,) = s.schedule().chunks
    assert chunk.start == 0  # nothing of y left to hit


def test_forgetting_an_entry_keeps_the_blocks_another_chain_or_a_request_uses() -> None:
    s = _scheduler(entries=1)
    shared = PROMPT[:20]  # 5 blocks
    a = _serve(s, "a", [*shared, *range(500, 520)])
    b = _serve(s, "b", [*shared, *range(600, 620)])  # a forgotten, but for the shared blocks
    assert (_cached_blocks(s, a), _cached_blocks(s, b)) == (5, 10)
    running = make_request("r", 0, prompt=[*b.prompt_token_ids[:32], 9, 9, 9, 9])
    s.add(running)
    _prefill(s)  # holds b's first 8 blocks
    _serve(s, "c", [p + 300 for p in PROMPT])  # b forgotten, but for the blocks in use
    assert _cached_blocks(s, b) == 8
    assert all(s.kv.pool.ref_count(i) == 1 for i in running.block_ids)


def test_a_limit_of_zero_entries_is_no_prefix_cache_in_the_engine_config() -> None:
    from inferd.config import EngineConfig

    assert not EngineConfig(prefix_cache_n=0).caches_prefixes
    assert EngineConfig(prefix_cache_n=1).caches_prefixes and EngineConfig().caches_prefixes


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


def test_a_reset_forgets_the_entries_and_the_limit_counts_the_new_ones_alone() -> None:
    """The entries' blocks lose their content in a reset: none is left to count against
    --prefix-cache-n or to forget later."""
    s = _scheduler(entries=1)
    _serve(s, "a", PROMPT)
    s.kv.reset_prefix_cache()
    assert s.kv.pool.num_entries == 0
    b = _serve(s, "b", [p + 100 for p in PROMPT])
    assert s.kv.pool.num_entries == 1 and _cached_blocks(s, b) == 10
    a = _serve(s, "a2", PROMPT)  # the same chain as before the reset: an entry of its own again
    assert s.kv.pool.num_entries == 1
    assert (_cached_blocks(s, a), _cached_blocks(s, b)) == (10, 0)
