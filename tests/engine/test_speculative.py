"""Prompt-lookup speculation without a model: drafting, verification, the sampled rejection
rule's distribution (a chi-square test on a small vocabulary), and the KV rollback of rejected
drafts through the real scheduler and block pool."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from inferd.engine.detokenizer import IncrementalDetokenizer
from inferd.engine.kv_cache import KVCacheManager
from inferd.engine.request import Request, RequestStatus
from inferd.engine.sampler import sample, sampling_probs
from inferd.engine.sampling import SamplingParams
from inferd.engine.scheduler import Scheduler, SchedulerConfig
from inferd.engine.speculative import DraftState, SpeculativeConfig, Speculator, draft_limit
from inferd.engine.thinking import ThinkingSpec
from inferd.structured.constraint import Constraint
from inferd.structured.matcher import LazyMatcher, TokenMatcher


def make_request(prompt: Sequence[int], output: Sequence[int] = (), **params: Any) -> Request:
    request = Request(
        request_id="r",
        prompt_token_ids=list(prompt),
        params=SamplingParams(**params),
        eos_token_ids=frozenset(),
        detokenizer=IncrementalDetokenizer(lambda t: b"x"),
    )
    request.output_token_ids.extend(output)
    return request


def test_drafts_follow_the_latest_longest_match() -> None:
    spec = Speculator(SpeculativeConfig(num_tokens=3))
    # "7 8 9" occurred twice; the suffix "8 9" continues after its latest occurrence: 4 5 6.
    request = make_request([7, 8, 9, 1, 2, 3, 7, 8, 9, 4, 5, 6, 0], [8, 9], max_tokens=50)
    assert spec.propose(request, 3) == (4, 5, 6)
    # The trigram "0 8 9" is unseen: the bigram "8 9" gave that; now "8 9 4" is known.
    request.output_token_ids.append(4)  # the index grows with the output
    assert spec.propose(request, 3) == (5, 6, 0)


def test_drafts_stop_at_the_sequence_end_and_max_tokens() -> None:
    spec = Speculator(SpeculativeConfig(num_tokens=8, first_tokens=8))
    request = make_request([1, 2, 3, 4], [1, 2], max_tokens=50)
    assert spec.propose(request, 8) == (3, 4, 1, 2)  # the continuation runs to the last token
    short = make_request([1, 2, 3, 4], [1, 2], max_tokens=4)
    short.request_id = "short"
    assert spec.propose(short, 8) == (3,)  # two tokens left: one draft and the model's own
    unseen = make_request([1, 2, 3, 4], [9], max_tokens=50)
    unseen.request_id = "unseen"
    assert spec.propose(unseen, 8) == ()


def agree(spec: Speculator, request: Request, draft: tuple[int, ...], vocab: int) -> None:
    """A verify step whose model agrees with every draft and then says ``draft[-1] + 1``."""
    logits = torch.full((len(draft) + 1, vocab), -1.0)
    following = [*draft, (draft[-1] + 1) % vocab]
    logits[torch.arange(len(draft) + 1), torch.tensor(following)] = 1.0
    assert spec.verify(logits, draft, request).accepted == len(draft)
    request.output_token_ids.extend(following)


def test_draft_length_grows_with_the_record_and_the_match() -> None:
    spec = Speculator(SpeculativeConfig(num_tokens=12, first_tokens=2))
    # A passage, then a copy of it that started with another token (99): a short match first.
    request = make_request([50, *range(30)], [99, 0, 1], temperature=0, max_tokens=100)
    lengths = []
    for _ in range(4):  # a copy: the model agrees with every draft
        draft = spec.propose(request, 12)
        lengths.append(len(draft))
        agree(spec, request, draft, 100)
    # 2 (the first length; a match of 2), then the match's length where it is longer than the
    # doubled record (5 tokens of the passage copied, then 11), up to num_tokens.
    assert lengths == [2, 5, 11, 12]
    draft = spec.propose(request, 12)
    logits = torch.zeros((len(draft) + 1, 100))
    logits[:, 19] = 1.0  # a miss at the first draft; the model says 19 (its match is short)
    assert spec.verify(logits, draft, request).accepted == 0
    request.output_token_ids.append(19)
    assert len(spec.propose(request, 12)) == 6  # half as long after the miss
    assert len(spec.propose(request, 1)) == 1  # the step's budget still caps it


def test_after_an_edit_the_copy_resumes_where_it_stood() -> None:
    """The model replaced a copied token by another: among equally short matches of the next
    one, the draft continues where the copy stood, not at the latest occurrence."""
    spec = Speculator(SpeculativeConfig(num_tokens=6, first_tokens=3))
    passage = [1, 2, 3, 4, 5, 6, 7, 8, 5, 9]
    request = make_request([*passage, 0], [1], temperature=0, max_tokens=100)
    draft = spec.propose(request, 6)
    assert draft == (2, 3, 4)
    logits = torch.zeros((4, 100))
    for row, best in enumerate([2, 3, 99]):  # the edit: 99 for 4
        logits[row, best] = 1.0
    assert spec.verify(logits, draft, request).tokens == [2, 3, 99]
    request.output_token_ids.extend([2, 3, 99])
    assert spec.propose(request, 6) == ()  # 99 is nowhere earlier
    request.output_token_ids.append(5)  # a plain step: the token after the replaced one
    assert spec.propose(request, 6) == (6, 7, 8)  # not the latest 5's continuation, 9
    fresh = make_request([*passage, 0], [1, 2, 3, 99, 5], temperature=0, max_tokens=100)
    fresh.request_id = "fresh"
    assert spec.propose(fresh, 6) == (9, 0, 1)  # no copy under way: the latest match


def test_draft_limits() -> None:
    """Drafts stop before max_tokens' last token and below a thinking budget (outside a
    constraint, where the budget forces the close); a lazy matcher still waiting drafts."""
    assert draft_limit(make_request([1], [2], temperature=0, max_tokens=50), 3) == 3
    assert draft_limit(make_request([1], [2, 2], temperature=0.8, seed=3, max_tokens=4), 3) == 1
    constrained = make_request([1], [2], temperature=0, constraint=Constraint.regex("a+"))
    constrained.matcher = LazyMatcher(None)  # waiting for a trigger: drafts are followed
    assert draft_limit(constrained, 3) == 3
    budget = ThinkingSpec("<think>", "</think>", (5,), budget=8, started_in_reasoning=True)
    thinking = make_request([1], temperature=0, thinking=budget, max_tokens=50)
    assert thinking.thinking is not None
    limits = []
    for _ in range(8):
        limits.append(draft_limit(thinking, 3))
        thinking.output_token_ids.append(2)
        thinking.thinking.feed("x")
    # 8 reasoning tokens: the 9th is forced; each verified row stays before it.
    assert limits == [3, 3, 3, 3, 3, 2, 1, 0]
    assert thinking.thinking.forced_token() == 5
    assert draft_limit(thinking, 3) == 0  # the forced token is a plain decode
    thinking.thinking.feed("")  # the closing token: the answer drafts freely
    assert draft_limit(thinking, 3) == 3
    # Under a constraint the budget forces nothing: no limit.
    fresh = make_request([1], temperature=0, thinking=budget, max_tokens=50)
    fresh.matcher = TokenMatcher(None)
    for _ in range(7):
        fresh.output_token_ids.append(2)
        assert fresh.thinking is not None
        fresh.thinking.feed("x")
    assert draft_limit(fresh, 3) == 3


def test_greedy_verification_takes_the_matching_prefix_and_the_argmax_after() -> None:
    spec = Speculator(SpeculativeConfig())
    request = make_request([1, 2], [3], temperature=0, max_tokens=50)
    logits = torch.full((4, 10), -5.0)
    for row, best in enumerate([4, 5, 9, 7]):
        logits[row, best] = 5.0
    verdict = spec.verify(logits, [4, 5, 6], request)
    assert (verdict.tokens, verdict.accepted) == ([4, 5, 9], 2)
    all_in = spec.verify(logits, [4, 5, 9], request)
    assert (all_in.tokens, all_in.accepted) == ([4, 5, 9, 7], 3)
    assert (spec.drafted, spec.accepted) == (6, 5)


def test_penalties_count_the_drafts_before_each_row() -> None:
    spec = Speculator(SpeculativeConfig())
    request = make_request([1, 2], [3], temperature=0, presence_penalty=2.0, max_tokens=50)
    logits = torch.zeros((3, 10))
    logits[0, 3], logits[0, 4] = 6.0, 5.0  # token 3 is already output: 6 - 2 < 5
    logits[1, 4], logits[1, 7] = 5.5, 4.0  # once draft 4 stands, it is output too: 3.5 < 4
    logits[2, 8] = 1.0
    verdict = spec.verify(logits, [4, 4], request)
    assert (verdict.tokens, verdict.accepted) == ([4, 7], 1)


def test_a_failing_request_pauses_drafting_then_tries_again() -> None:
    cfg = SpeculativeConfig(num_tokens=2, first_pause=3)
    spec = Speculator(cfg)
    request = make_request([5, 6, 7, 5, 6], [7], temperature=0, max_tokens=50)
    draft = spec.propose(request, 2)
    assert draft == (5, 6)
    logits = torch.zeros((3, 10))
    logits[:, 0] = 1.0  # the model wants token 0 everywhere: every draft is rejected
    assert spec.verify(logits, draft, request).accepted == 0
    assert spec.propose(request, 2) == (5, 6)  # one miss: it keeps drafting
    assert spec.verify(logits, draft, request).accepted == 0
    assert [spec.propose(request, 2) for _ in range(3)] == [(), (), ()]  # two: a pause
    assert spec.propose(request, 2) == (5, 6)  # then a probe, whose miss pauses twice as long
    assert spec.verify(logits, draft, request).accepted == 0
    assert [spec.propose(request, 2) for _ in range(7)] == [()] * 6 + [(5, 6)]
    assert spec.states["r"].pause == 6


def test_a_paused_request_still_drafts_from_a_long_match() -> None:
    """In a pause, short matches draft nothing; a match of ``sure_match`` tokens or more (the
    text repeating itself) drafts, as long as the match."""
    spec = Speculator(SpeculativeConfig(num_tokens=16, first_pause=50, sure_match=6))
    loop = [11, 12, 13, 14, 15, 16, 17, 18]
    request = make_request([1, 2, 3], [*loop, 9, 11, 12], temperature=0, max_tokens=100)
    spec.states["r"] = state = DraftState(paused=50)
    assert spec.propose(request, 16) == ()  # "11 12": a match of 2
    request.output_token_ids.extend([13, 14, 15])
    assert spec.propose(request, 16) == ()  # 5
    request.output_token_ids.append(16)
    assert spec.propose(request, 16) == (17, 18, 9, 11, 12, 13)  # 6: the loop, 6 long
    assert state.paused == 50 - 3


def test_sampled_verification_preserves_the_distribution() -> None:
    """Chi-square of the first emitted token, and of the second given the first draft was
    accepted, against the distribution plain sampling draws from (temperature, top-k)."""
    vocab, trials = 8, 6000
    torch.manual_seed(0)
    logits = torch.randn(3, vocab) * 1.5
    request = make_request([1], [2], temperature=0.9, top_k=6, max_tokens=50)
    request.generator = torch.Generator().manual_seed(1234)  # as a seeded request's
    expected = [sampling_probs(row, request) for row in logits]
    expected = [p / p.sum() for p in expected]
    # Drafts: a likely token first, then one top-k filters out (always rejected).
    draft = [int(expected[0].argsort()[-2]), int(expected[1].argmin())]
    spec = Speculator(SpeculativeConfig())
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for _ in range(trials):
        tokens = spec.verify(logits, draft, request).tokens
        first[tokens[0]] += 1
        if tokens[0] == draft[0]:
            second[tokens[1]] += 1
    assert 0 < first[draft[0]] < trials  # both accepted and rejected draws happened
    assert second[draft[1]] == 0  # a token of probability zero is never emitted
    for counts, probs in ((first, expected[0]), (second, expected[1])):
        assert torch.all(counts[probs == 0] == 0)
        live = probs > 0
        want = probs[live] * counts.sum()
        chi2 = float(((counts[live] - want) ** 2 / want).sum())
        # df = 5 (six tokens left by top-k): P(chi2 > 20.5) = 0.001 under the null.
        assert int(live.sum()) == 6
        assert chi2 < 20.5, (counts, want)


def test_seeded_verification_emits_the_plain_draws() -> None:
    """A seeded request: whatever was drafted, verification emits the tokens plain sampling
    draws at those positions (so its text does not depend on speculation), and a draft equal
    to the plain draw stands."""
    vocab = 8
    torch.manual_seed(1)
    logits = torch.randn(3, vocab)
    spec = Speculator(SpeculativeConfig())
    accepted = 0
    for seed in range(200):
        request = make_request([1], [2], temperature=0.9, top_k=6, seed=seed, max_tokens=50)
        plain = []
        for row in logits:  # one plain decode per position, as without speculation
            plain.append(sample(row[None], [request]).token_ids[0])
            request.output_token_ids.append(plain[-1])
        del request.output_token_ids[1:]
        # Drafts: the first plain token (always accepted) or another, then a likely token.
        first = plain[0] if seed % 2 else (plain[0] + 1) % vocab
        verdict = spec.verify(logits, [first, int(logits[1].argmax())], request)
        n = len(verdict.tokens)
        assert verdict.tokens == plain[:n]
        assert verdict.accepted == n - 1
        assert (verdict.accepted > 0) == (first == plain[0])
        accepted += verdict.accepted
    assert accepted > 100  # the odd seeds' first drafts, and likely second ones


def test_rejected_drafts_give_their_blocks_back() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    spec = Speculator(SpeculativeConfig(num_tokens=6, first_tokens=6, max_batch_rows=8))
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv, speculator=spec)
    passage = [10, 11, 12, 13, 14, 15, 16, 17, 18]
    request = make_request([*passage, 1, 10, 11], max_tokens=40, temperature=0)
    scheduler.add(request)
    prefill = scheduler.schedule()
    scheduler.advance(prefill)
    request.output_token_ids.append(12)  # the model's first token: the passage again
    step = scheduler.schedule()
    (chunk,) = step.chunks
    assert chunk.draft == (13, 14, 15, 16, 17, 18)
    assert chunk.token_ids() == [12, 13, 14, 15, 16, 17, 18]
    held = len(request.block_ids)
    assert held == kv.blocks_for(request.num_tokens + 6)  # room for every draft: 19 tokens
    scheduler.advance(step)
    assert request.num_computed_tokens == request.num_tokens == 13  # the drafts not yet
    request.output_token_ids.extend([13, 99])  # one draft accepted, then the model's own
    scheduler.settle(request, accepted=1)
    assert request.num_computed_tokens == request.num_tokens - 1 == 14
    assert len(request.block_ids) == kv.blocks_for(request.num_tokens) == 4 < held
    # Only blocks of accepted tokens are in the prefix cache: the first three (12 tokens).
    assert kv.pool.num_cached == 3
    assert kv.pool.num_used == 4
    scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
    assert kv.pool.num_used == 0 and spec.states == {}


def test_large_batches_do_not_draft() -> None:
    spec = Speculator(SpeculativeConfig(num_tokens=4, max_batch_rows=8))
    assert spec.draft_budget(1) == 4
    assert spec.draft_budget(2) == 3  # 2 x (1 + 3) rows
    assert spec.draft_budget(4) == 1
    assert spec.draft_budget(5) == 0


def test_a_lone_decode_verifies_long_drafts_only_while_no_prompt_waits() -> None:
    spec = Speculator(SpeculativeConfig(num_tokens=31, max_batch_rows=8, max_verify_rows=32))
    assert spec.draft_budget(1) == 31
    assert spec.draft_budget(1, prompts_pending=True) == 7  # the prompts' budget comes first
    assert spec.draft_budget(2, prompts_pending=True) == 3
