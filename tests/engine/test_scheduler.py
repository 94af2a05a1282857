from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.engine.kv_cache import KVCacheManager
from inferd.engine.request import RequestStatus
from inferd.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, _whole_spans
from tests.engine.helpers import make_request


def _scheduler(
    blocks: int = 64, block_size: int = 4, seqs: int = 4, budget: int = 16, prefix: bool = True
) -> Scheduler:
    kv = KVCacheManager(blocks, block_size, prefix_caching=prefix)
    return Scheduler(SchedulerConfig(seqs, budget), kv)


def _run_step(s: Scheduler, token: int = 7) -> list[str]:
    """Schedule, pretend the model ran, append one token to completed chunks; finished ids."""
    out = s.schedule()
    s.advance(out)
    done = []
    for chunk in out.chunks:
        if chunk.completes:
            req = chunk.request
            req.output_token_ids.append(token)
            if len(req.output_token_ids) >= req.params.max_tokens:
                s.finish(req, RequestStatus.FINISHED_LENGTH)
                done.append(req.request_id)
    return done


def test_long_prompt_is_chunked_and_decodes_keep_running() -> None:
    s = _scheduler(budget=8)
    short = make_request("short", 3, max_tokens=20)
    s.add(short)
    _run_step(s)  # short prefilled, first token sampled
    s.add(make_request("long", 30))
    out = s.schedule()
    sizes = {c.request.request_id: c.num_tokens for c in out.chunks}
    assert sizes == {"short": 1, "long": 7}  # the decode goes first, the prompt takes the rest
    assert out.num_batched_tokens == 8


def test_block_ids_and_ref_counts_are_exact() -> None:
    s = _scheduler(blocks=10, block_size=4)
    a, b = make_request("a", 5), make_request("b", 3)
    s.add(a)
    s.add(b)
    s.schedule()
    assert a.block_ids == [1, 2] and b.block_ids == [3]
    assert all(s.kv.pool.ref_count(i) == 1 for i in (1, 2, 3))
    assert s.kv.pool.num_used == 3
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    assert s.kv.pool.ref_count(1) == 0 and s.kv.pool.num_used == 1


def test_max_seqs_caps_running_requests() -> None:
    s = _scheduler(seqs=2)
    for i in range(4):
        s.add(make_request(f"r{i}", 2))
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["r0", "r1"]
    assert len(s.waiting) == 2


def test_pool_exhaustion_preempts_the_newest_request() -> None:
    s = _scheduler(blocks=5, block_size=4, budget=64)  # 4 usable blocks = 16 tokens
    old, new = make_request("old", 7, max_tokens=30), make_request("new", 7, max_tokens=30)
    s.add(old)
    s.add(new)
    _run_step(s)  # each holds 2 blocks; the pool is full
    assert s.kv.pool.num_free == 0
    _run_step(s)  # 8 tokens each still fit in 2 blocks
    out = s.schedule()  # "old" needs a third block: "new" is preempted for it
    assert out.preempted == ("new",)
    assert [c.request.request_id for c in out.chunks] == ["old"]
    assert (
        new.status is RequestStatus.WAITING and new.block_ids == [] and new.num_computed_tokens == 0
    )
    assert s.waiting[0] is new and s.num_preemptions == 1


def test_preempted_request_recomputes_its_generated_tokens() -> None:
    s = _scheduler(blocks=5, block_size=4, budget=64, prefix=False)
    old, new = make_request("old", 7, max_tokens=30), make_request("new", 7, max_tokens=30)
    s.add(old)
    s.add(new)
    for _ in range(3):
        _run_step(s)
    s.finish(old, RequestStatus.FINISHED_ABORTED)
    out = s.schedule()
    (chunk,) = out.chunks
    assert chunk.request is new and chunk.start == 0 and chunk.num_tokens == new.num_tokens


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 3)),
        min_size=1,
        max_size=12,
    ),
    st.integers(4, 40),
    st.integers(1, 6),
)
def test_random_arrivals_all_finish_and_blocks_return(
    specs: list[tuple[int, int, int]], blocks: int, seqs: int
) -> None:
    """No starvation, no leak: every request that fits the pool eventually finishes."""
    block_size, budget = 4, 16
    s = _scheduler(blocks=blocks + 14, block_size=block_size, seqs=seqs, budget=budget)
    capacity = s.kv.capacity_tokens
    pending = [
        make_request(f"r{i}", p, m) for i, (p, m, _) in enumerate(specs) if p + m <= capacity
    ]
    delays = {f"r{i}": d for i, (_, _, d) in enumerate(specs)}
    finished: set[str] = set()
    rng = random.Random(0)
    for step in range(2000):
        for req in [r for r in pending if delays[r.request_id] <= step]:
            s.add(req)
            pending.remove(req)
        finished.update(_run_step(s, rng.randrange(100)))
        assert s.kv.pool.num_used == sum(len(r.block_ids) for r in s.running)
        if not pending and not s.has_work:
            break
    assert not s.has_work and not pending
    assert s.kv.pool.num_used == 0
    assert len(finished) == sum(1 for p, m, _ in specs if p + m <= capacity)


def test_a_short_request_is_not_stalled_by_a_burst_of_long_prompts() -> None:
    # One API request with n=4 choices of a 40-token prompt (each longer than a step's budget
    # of 16), then a short request: it starts at the next step, not after the long ones.
    s = _scheduler(blocks=64, block_size=4, seqs=4, budget=16)
    same = list(range(500, 540))
    for i in range(4):
        s.add(make_request(f"long{i}", 0, max_tokens=2, prompt=list(same)))
    _run_step(s)
    short = make_request("short", 5, max_tokens=2)
    s.add(short)
    out = s.schedule()
    sizes = {c.request.request_id: c.num_tokens for c in out.chunks}
    assert sizes.get("short") == 5  # admitted with its whole prompt in the first step
    assert [r.request_id for r in s.running] == ["long0", "short"]  # one long prefill at a time
    assert sizes["long0"] == 16 - 5  # the long prefill took what the short one left


def test_later_copies_of_a_long_prompt_wait_for_the_first_and_reuse_its_blocks() -> None:
    s = _scheduler(blocks=64, block_size=4, seqs=4, budget=16)
    same = list(range(500, 540))
    copies = [make_request(f"long{i}", 0, max_tokens=2, prompt=list(same)) for i in range(3)]
    for request in copies:
        s.add(request)
    first_chunks: dict[str, int] = {}
    computed = 0
    while s.has_work:
        out = s.schedule()
        for chunk in out.chunks:
            first_chunks.setdefault(chunk.request.request_id, chunk.start)
            computed += chunk.num_tokens
        s.advance(out)
        for chunk in out.chunks:
            if chunk.completes:
                chunk.request.output_token_ids.append(7)
                if len(chunk.request.output_token_ids) >= 2:
                    s.finish(chunk.request, RequestStatus.FINISHED_LENGTH)
    # The copies started where the first one's cached blocks ended, not from token 0.
    assert first_chunks["long0"] == 0
    assert first_chunks["long1"] >= 32 and first_chunks["long2"] >= 32
    assert computed < 40 + 2 * 8 + 3 * 2  # one full prompt, two short tails, the decodes


def test_chunks_never_end_inside_a_bidirectional_span() -> None:
    """A chunk that would end inside a span ends before it; one that starts at (or in) a span
    takes the whole span even past the budget (its first rows must see its last keys)."""
    s = _scheduler(blocks=64, budget=8)
    req = make_request("image", 40)
    req.bidirectional_spans = ((5, 17), (20, 24), (30, 34))
    s.add(req)
    ends = []
    while req.num_computed_tokens < req.num_prompt_tokens:
        out = s.schedule()
        ends += [c.start + c.num_tokens for c in out.chunks]
        s.advance(out)
    # 0-8 would cut the first span: 0-5; 5-13 too: the whole span 5-17 (12 > 8); 17-25 ends
    # past the second; 25-33 would cut the third: 25-30; then 30-38 and the rest.
    assert ends == [5, 17, 25, 30, 38, 40]
    resumed = make_request("resumed", 30)
    resumed.bidirectional_spans = ((2, 12),)
    resumed.num_computed_tokens = 4  # as after a prefix-cache hit inside the span
    assert _whole_spans(resumed, 3) == 8  # 4-7 would end inside: on to the span's end
    assert _whole_spans(resumed, 10) == 10  # 4-14 ends past it


def _step_kinds(limit: int | None, steps: int) -> str:
    """Per step, "P" when it ran prompt work (the long prompt's chunks), else "D" (decodes
    alone), for a 30-token prompt arriving while a reply decodes (budget 8: chunks of 7)."""
    config = SchedulerConfig(4, 8, max_decode_steps_before_prefill=limit)
    s = Scheduler(config, KVCacheManager(64, 4))
    s.add(make_request("short", 3, max_tokens=100))
    _run_step(s)  # its prompt step; it decodes from now on
    s.add(make_request("long", 30, max_tokens=100))
    kinds = ""
    for _ in range(steps):
        out = s.schedule()
        assert any(c.request.request_id == "short" for c in out.chunks)  # it never waits
        prompt = [c for c in out.chunks if c.start < c.request.num_prompt_tokens]
        kinds += "P" if prompt else "D"
        s.advance(out)
        for chunk in out.chunks:
            if chunk.completes:
                chunk.request.output_token_ids.append(7)
    return kinds


def test_max_decode_steps_before_prefill_spaces_the_prompt_chunks() -> None:
    """mistral.rs's rule: prompt work never in the step after one that ran some, then after N
    steps of decodes alone, or at once when what is left fits the step (the last 2 tokens)."""
    assert _step_kinds(None, 6) == "PPPPPD"  # chunks of 7, 7, 7, 7, 2 beside the decode
    assert _step_kinds(2, 16) == "DDPDDPDDPDDPDPDD"
    assert _step_kinds(1, 10) == "DPDPDPDPDP"


def test_no_kv_cache_recomputes_the_whole_sequence_for_every_token() -> None:
    """Each sampled token frees the request's blocks: the next step computes its prompt and
    output again from position 0, chunked by the budget as a prompt is."""

    def chunks(no_kv_cache: bool) -> list[tuple[int, int]]:
        config = SchedulerConfig(4, 4, no_kv_cache=no_kv_cache)
        s = Scheduler(config, KVCacheManager(64, 4, prefix_caching=False))
        s.add(make_request("r", 5, max_tokens=3))
        seen = []
        while s.has_work:
            out = s.schedule()
            seen += [(c.start, c.num_tokens) for c in out.chunks]
            _run_step_after(s, out)
        assert s.kv.pool.num_used == 0
        return seen

    assert chunks(False) == [(0, 4), (4, 1), (5, 1), (6, 1)]
    assert chunks(True) == [(0, 4), (4, 1), (0, 4), (4, 2), (0, 4), (4, 3)]


def _run_step_after(s: Scheduler, out: SchedulerOutput) -> None:
    """``_run_step`` for a step already scheduled."""
    s.advance(out)
    for chunk in out.chunks:
        if chunk.completes:
            req = chunk.request
            req.output_token_ids.append(7)
            if len(req.output_token_ids) >= req.params.max_tokens:
                s.finish(req, RequestStatus.FINISHED_LENGTH)
