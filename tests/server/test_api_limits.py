"""The API's limits on a request, checked in the server before the engine sees it."""

from __future__ import annotations

import pytest

from inferd.engine.sampling import SamplingParamError
from inferd.server.api_limits import (
    MAX_CHOICES,
    MAX_N,
    LogprobsAsk,
    check_logprobs_size,
    check_n,
    check_sampling_limits,
)
from inferd.server.errors import APIError


@pytest.mark.parametrize(
    ("stop", "logprobs", "param", "message"),
    [
        (("a", "b", "c", "d", "e"), None, "stop", "at most 4 stop strings, got 5"),
        ((), 21, "logprobs", "must be between 0 and 20, got 21"),
        ((), -1, "logprobs", "must be between 0 and 20, got -1"),
    ],
)
def test_over_a_limit_names_the_field(
    stop: tuple[str, ...], logprobs: int | None, param: str, message: str
) -> None:
    with pytest.raises(SamplingParamError) as info:
        check_sampling_limits(stop, logprobs)
    assert info.value.param == param and str(info.value) == f"{param} {message}"


def test_at_the_limits_passes() -> None:
    check_sampling_limits(("a", "b", "c", "d"), 20)
    check_sampling_limits((), 0)
    assert check_n(None) == 1
    assert check_n(MAX_N, num_prompts=MAX_CHOICES // MAX_N) == MAX_N


@pytest.mark.parametrize(
    ("n", "prompts", "message"),
    [(0, 1, "between 1 and 16, got 0"), (17, 1, "got 17"), (16, 5, "80 choices; at most 64")],
)
def test_n_out_of_range_is_a_400(n: int, prompts: int, message: str) -> None:
    with pytest.raises(APIError) as info:
        check_n(n, prompts)
    assert info.value.status == 400 and info.value.param == "n" and message in info.value.message


def test_logprobs_beyond_the_bound_are_a_400_naming_the_field() -> None:
    ask = LogprobsAsk(n=4, k=20, k_param="top_logprobs", advice="lower n")
    check_logprobs_size(4 * 100 * 21, ask, 100, "completion tokens")  # exactly at the bound
    with pytest.raises(APIError) as info:
        check_logprobs_size(4 * 100 * 21 - 1, ask, 100, "completion tokens")
    assert info.value.status == 400 and info.value.param == "top_logprobs"
    assert "8400 (token, logprob) pairs: n=4 x 100 completion tokens x (1 + top_logprobs=20)" in (
        info.value.message
    )
    assert "(--max-logprobs-tokens); lower n" in info.value.message


def test_the_most_tokens_within_the_bound() -> None:
    ask = LogprobsAsk(n=2, k=5, k_param="top_logprobs", advice="")
    assert ask.most_tokens(100) == 8 and ask.pairs(8) <= 100 < ask.pairs(9)
    assert ask.most_tokens(11) == 0
