"""The sampler against hand-computed references on small logits (no model needed)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.engine.detokenizer import IncrementalDetokenizer
from inferd.engine.request import Request
from inferd.engine.sampler import apply_logit_transforms, sample
from inferd.engine.sampling import GREEDY_TEMPERATURE, SamplingParamError, SamplingParams


def make_request(rid: str, prompt_len: int, **params: Any) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(prompt_len)),
        params=SamplingParams(**params),
        eos_token_ids=frozenset(),
        detokenizer=IncrementalDetokenizer(lambda t: b"x"),
    )


def _row(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_greedy_rows_take_the_argmax_and_carry_no_logprobs() -> None:
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    out = sample(logits, [make_request(f"r{i}", 2, temperature=0) for i in range(2)])
    assert out.token_ids == [1, 0]
    assert out.logprobs == [None, None]


def test_logit_bias_is_added_to_the_named_tokens() -> None:
    params = SamplingParams(logit_bias=((0, 5.0), (3, -1.5)))
    got = apply_logit_transforms(_row([1.0, 2.0, 3.0, 0.0]), params, [], [])
    assert got.tolist() == [6.0, 2.0, 3.0, -1.5]
    # greedy then follows the biased logits, and -100 bans a token outright
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    banned = make_request("r", 1, temperature=0, logit_bias=((2, -100.0),))
    assert sample(logits, [banned]).token_ids == [1]
    forced = make_request("r", 1, temperature=0, logit_bias=((3, 100.0),))
    assert sample(logits, [forced]).token_ids == [3]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    params = SamplingParams(repetition_penalty=2.0)
    got = apply_logit_transforms(_row([2.0, -1.0, 0.5, 3.0]), params, [0], [1, 1])
    # tokens 0 (prompt) and 1 (output) were seen; 2 and 3 were not
    assert got.tolist() == [1.0, -2.0, 0.5, 3.0]


def test_frequency_and_presence_penalties_follow_openai_formula() -> None:
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    logits = [1.0, 2.0, 3.0, 4.0]
    got = apply_logit_transforms(_row(logits), params, [3, 3, 3], [2, 2, 1])
    # logit[j] - count[j] * frequency - (count[j] > 0) * presence, over output tokens only
    counts = [0, 1, 2, 0]
    want = [x - c * 0.5 - (1.0 if c else 0.0) for x, c in zip(logits, counts, strict=True)]
    assert got.tolist() == pytest.approx(want)
    negative = SamplingParams(frequency_penalty=-1.0)
    assert apply_logit_transforms(_row(logits), negative, [], [0]).tolist() == [2.0, 2, 3, 4]


def test_bias_comes_before_the_repetition_penalty() -> None:
    params = SamplingParams(logit_bias=((0, 3.0),), repetition_penalty=2.0)
    got = apply_logit_transforms(_row([-1.0, 1.0]), params, [0], [])
    assert got.tolist() == [1.0, 1.0]  # (-1 + 3) / 2


def test_transforms_never_modify_the_callers_logits() -> None:
    logits = _row([1.0, 2.0])
    apply_logit_transforms(logits, SamplingParams(logit_bias=((0, 1.0),)), [], [])
    assert logits.tolist() == [1.0, 2.0]


def test_penalties_steer_greedy_away_from_repeats() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    request = make_request("r", 1, temperature=0, presence_penalty=1.0)
    request.output_token_ids.extend([0])
    assert sample(logits, [request]).token_ids == [1]


def test_logprobs_equal_log_softmax_of_the_raw_logits() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    requests = [
        make_request("a", 4, temperature=0, logprobs=5),
        make_request("b", 4, temperature=0.7, seed=3, logprobs=20, frequency_penalty=1.5),
        make_request("c", 4, temperature=0),
    ]
    requests[1].output_token_ids.extend([1, 2, 3])
    out = sample(logits, requests)
    reference = torch.log_softmax(logits, dim=-1)
    for row in (0, 1):
        lp = out.logprobs[row]
        assert lp is not None and lp.token_id == out.token_ids[row]
        assert lp.logprob == pytest.approx(reference[row, lp.token_id].item(), abs=1e-6)
        want = sorted(range(50), key=lambda t: -reference[row, t].item())
        k = requests[row].params.logprobs
        assert [t for t, _ in lp.top] == want[:k]
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx([reference[row, t].item() for t in want[:k]], abs=1e-6)
    assert out.logprobs[2] is None
    assert out.token_ids[0] == int(logits[0].argmax()) and out.token_ids[2] == int(
        logits[2].argmax()
    )


def test_zero_top_logprobs_still_reports_the_chosen_token() -> None:
    logits = torch.tensor([[0.0, math.log(3.0)]])
    lp = sample(logits, [make_request("r", 1, temperature=0, logprobs=0)]).logprobs[0]
    assert lp is not None and lp.token_id == 1 and lp.top == ()
    assert lp.logprob == pytest.approx(math.log(0.75))


def test_half_precision_logits_are_handled() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]], dtype=torch.bfloat16)
    request = make_request("r", 1, temperature=0, logprobs=1, logit_bias=((0, 10.0),))
    out = sample(logits, [request])
    assert out.token_ids == [0]
    lp = out.logprobs[0]
    assert lp is not None and lp.top[0][0] == 2


def test_seeded_sampling_is_reproducible_and_seeds_differ() -> None:
    logits = torch.zeros(1, 1000)

    def draws(seed: int) -> list[int]:
        request = make_request("r", 1, temperature=1.0, seed=seed)
        for _ in range(8):
            request.output_token_ids.append(sample(logits, [request]).token_ids[0])
        return request.output_token_ids

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert len(set(draws(7))) > 4  # each position draws afresh


def test_a_seeded_draw_depends_only_on_the_seed_and_the_position() -> None:
    """Whatever was drawn before (speculation draws more or fewer times), output position i
    of a seeded request draws the same token; unrelated requests beside it change nothing."""
    logits = torch.zeros(1, 1000)
    request = make_request("r", 1, temperature=1.0, seed=11)
    request.output_token_ids.extend([5, 6, 7])
    at_three = sample(logits, [request]).token_ids[0]
    for _ in range(5):  # the same position drawn again, after other draws of other requests
        torch.rand(100)
        other = make_request("o", 1, temperature=1.0, seed=12)
        token = sample(logits.repeat(2, 1), [other, request]).token_ids[1]
        assert token == at_three
    request.output_token_ids[:] = [9, 9, 9]  # the position, not the tokens before, keys it
    assert sample(logits, [request]).token_ids[0] == at_three


def test_sampled_frequencies_follow_the_transformed_distribution() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0]])
    request = make_request(
        "r", 1, temperature=1.0, logit_bias=((0, math.log(2.0)),), presence_penalty=1.0
    )
    request.generator = torch.Generator().manual_seed(1)  # one stream over all the draws
    request.output_token_ids.append(2)  # token 2 pays the presence penalty
    weights = [2.0, 1.0, math.exp(-1.0)]
    want = [w / sum(weights) for w in weights]
    counts = [0, 0, 0]
    draws = 4000
    for _ in range(draws):
        counts[sample(logits, [request]).token_ids[0]] += 1
    assert [c / draws for c in counts] == pytest.approx(want, abs=0.03)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": ((5, 101.0),)}, "logit_bias"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_new_parameters_are_range_checked(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(SamplingParamError) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert info.value.param == param


def test_draws_never_pick_tokens_of_zero_probability() -> None:
    from inferd.engine.sampler import draw

    generator = torch.Generator().manual_seed(5)
    probs = torch.zeros(49152)
    probs[[3, 40000, 49150]] = torch.tensor([0.2, 0.5, 0.3])  # the last tokens have none
    counts = {3: 0, 40000: 0, 49150: 0}
    for _ in range(3000):
        counts[draw(probs, generator)] += 1  # a KeyError would be a zero-probability token
    assert [counts[t] / 3000 for t in (3, 40000, 49150)] == pytest.approx([0.2, 0.5, 0.3], abs=0.03)


@pytest.mark.parametrize("spread", [0.5, 6.0])  # 0.5: flat, the nucleus needs the whole sort
def test_top_p_keeps_the_smallest_set_reaching_the_mass(spread: float) -> None:
    from inferd.engine.sampler import _top_p

    torch.manual_seed(6)
    probs = torch.softmax(torch.randn(49152) * spread, dim=-1)
    kept = _top_p(probs, 0.9)
    ordered = probs.sort(descending=True).values
    size = int((ordered.cumsum(0) - ordered < 0.9).sum())  # tokens whose mass above is < 0.9
    assert int((kept > 0).sum()) == size
    assert bool((kept[kept > 0] >= ordered[size - 1]).all())  # they are the likeliest ones
    assert torch.equal(kept[kept > 0], probs[kept > 0])


@settings(max_examples=60, deadline=None)
@given(
    temperature=st.floats(min_value=0.0, max_value=GREEDY_TEMPERATURE, exclude_min=True).filter(
        lambda t: t < GREEDY_TEMPERATURE
    ),
    seed=st.integers(min_value=0, max_value=2**32),
    top_p=st.sampled_from([1.0, 0.9, 0.5]),
)
def test_any_temperature_below_the_greedy_threshold_samples_greedily(
    temperature: float, seed: int, top_p: float
) -> None:
    # Logits with a clear winner that is not the last id: dividing them by 1e-40 used to
    # overflow to inf and draw the last vocabulary id.
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(seed)) * 10
    requests = [
        make_request(f"r{i}", 3, temperature=temperature, seed=seed, top_p=top_p, logprobs=2)
        for i in range(2)
    ]
    out = sample(logits, requests)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert all(lp is not None and math.isfinite(lp.logprob) for lp in out.logprobs)


def test_the_smallest_sampling_temperature_neither_overflows_nor_collapses() -> None:
    # At exactly the threshold the row is sampled; huge logits still give a finite draw.
    logits = _row([3.0e4, 2.9e4, -3.0e4, 1.0])
    request = make_request("r", 1, temperature=GREEDY_TEMPERATURE, seed=0)
    assert not request.params.greedy
    assert sample(logits[None], [request]).token_ids == [0]
