"""The API's limits on a request, checked in the server before the engine sees it."""

from __future__ import annotations

import pytest

from inferd.engine.sampling import SamplingParamError
from inferd.server.api_limits import MAX_CHOICES, MAX_N, check_n, check_sampling_limits
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
