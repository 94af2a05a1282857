"""Verification of a draft model's sampled drafts without a model: the general rejection rule
(accept ``x ~ q`` with probability ``min(1, p(x) / q(x))``, else draw from ``max(0, p - q)``)
emits tokens distributed as ``p`` (a chi-square test on a small vocabulary, q != p), and with
``q`` a point mass it decides exactly as the prompt-lookup rule does."""

from __future__ import annotations

import torch

from inferd.engine.draft_model import Draft
from inferd.engine.sampler import draw, sampling_probs
from inferd.engine.speculative import SpeculativeConfig, Speculator
from tests.engine.test_speculative import make_request


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    assert torch.all(counts[probs == 0] == 0)  # a token of probability zero is never emitted
    live = probs > 0
    want = probs[live] * counts.sum()
    return float(((counts[live] - want) ** 2 / want).sum()), int(live.sum()) - 1


def test_draft_model_rule_preserves_the_distribution() -> None:
    """Chi-square of the first emitted token, and of the second given the first draft was
    accepted, with drafts drawn from a q unlike p (q even puts mass where top-k leaves none)."""
    vocab, trials = 8, 6000
    torch.manual_seed(0)
    logits = torch.randn(3, vocab) * 1.5
    request = make_request([1], [2], temperature=0.9, top_k=6, max_tokens=50)
    request.generator = torch.Generator().manual_seed(1234)
    expected = [p / p.sum() for p in (sampling_probs(row, request) for row in logits)]
    q = [torch.softmax(torch.randn(vocab), dim=-1) for _ in range(2)]
    assert all(float((qi - pi).abs().max()) > 0.1 for qi, pi in zip(q, expected, strict=False))
    assert float(q[0][expected[0] == 0].sum()) > 0  # drafts p never emits
    drafts = torch.Generator().manual_seed(99)
    spec = Speculator(SpeculativeConfig())
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    accepted = 0
    for _ in range(trials):
        draft = [draw(q[0], drafts), draw(q[1], drafts)]
        spec.draft_probs["r"] = list(q)  # as a draft model's propose leaves them
        verdict = spec.verify(logits, draft, request)
        first[verdict.tokens[0]] += 1
        if verdict.accepted >= 1:
            accepted += 1
            second[verdict.tokens[1]] += 1
    assert 0 < accepted < trials  # both accepted and rejected drafts happened
    for counts, probs in ((first, expected[0]), (second, expected[1])):
        chi2, df = _chi2(counts, probs)
        assert df == 5
        # df = 5: P(chi2 > 20.5) = 0.001 under the null.
        assert chi2 < 20.5, (counts, probs * counts.sum())
    assert spec.draft_probs == {}  # verify took them


def test_a_point_mass_q_decides_as_prompt_lookup_does() -> None:
    vocab = 8
    torch.manual_seed(3)
    logits = torch.randn(4, vocab)
    request = make_request([1], [2], temperature=1.0, max_tokens=50)
    spec = Speculator(SpeculativeConfig())
    for trial in range(200):
        draft = [trial % vocab, (trial * 3) % vocab, (trial * 5) % vocab]
        request.generator = torch.Generator().manual_seed(trial)
        lookup = spec.verify(logits, draft, request)
        request.generator = torch.Generator().manual_seed(trial)
        spec.draft_probs["r"] = [torch.nn.functional.one_hot(torch.tensor(t), vocab) for t in draft]
        model = spec.verify(logits, draft, request)
        assert model == lookup


class _Drafter:
    """A draft model that proposes token 5 as often as it is asked."""

    def propose(self, request: object, k: int) -> Draft:
        return Draft([5] * k, None)

    def forget(self, request_id: str) -> None:
        pass


def test_a_draft_model_proposes_one_token_until_one_stands() -> None:
    """Each draft costs a draft-model pass: a request drafts one token a step until a draft is
    accepted (self-drafting with SmolLM2's first layers never is), then its usual lengths."""
    spec = Speculator(SpeculativeConfig(method="draft", num_tokens=7), drafter=_Drafter())  # type: ignore[arg-type]
    request = make_request([1, 2], [3], temperature=0, max_tokens=50)
    assert spec.propose(request, 7) == (5,)
    miss = torch.zeros(2, 8)
    miss[:, 4] = 1.0  # the model's argmax is 4 at every row: the draft 5 fails
    spec.verify(miss, [5], request)
    assert spec.propose(request, 7) == (5,)
    hit = torch.zeros(2, 8)
    hit[:, 5] = 1.0
    assert spec.verify(hit, [5], request).accepted == 1
    assert len(spec.propose(request, 7)) > 1
