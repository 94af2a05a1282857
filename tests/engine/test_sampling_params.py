from __future__ import annotations

import pytest

from inferd.engine.sampling import SamplingParamError, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"stop": ("",)}, "stop"),
        ({"seed": -1}, "seed"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ],
)
def test_out_of_range_values_name_the_parameter(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(SamplingParamError) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert info.value.param == param
    assert isinstance(info.value, ValueError)


def test_greedy_when_temperature_zero_or_top_k_one() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(top_k=1).greedy
    assert not SamplingParams(temperature=0.7).greedy


def test_api_limits_are_not_the_engines() -> None:
    """Stop-string and logprob counts are bounded by the HTTP API (server/api_limits.py)."""
    params = SamplingParams(stop=tuple("abcdef"), logprobs=50, prompt_logprobs=50)
    assert len(params.stop) == 6 and params.logprobs == 50
