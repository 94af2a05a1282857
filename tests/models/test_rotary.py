"""Rotary frequencies against transformers' own Llama rotary embedding, per scaling kind."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from inferd.layers.rotary import RopeScaling, RotaryEmbedding, inverse_frequencies

HEAD_DIM, BASE = 64, 500000.0

CASES: list[tuple[RopeScaling, dict[str, Any] | None]] = [
    (RopeScaling(), None),
    (RopeScaling(kind="linear", factor=4.0), {"rope_type": "linear", "factor": 4.0}),
    (
        RopeScaling(
            kind="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position=8192,
        ),
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
]


def _hf_inv_freq(scaling: dict[str, Any] | None) -> torch.Tensor:
    cfg = LlamaConfig(
        hidden_size=HEAD_DIM * 4,
        num_attention_heads=4,
        rope_theta=BASE,
        max_position_embeddings=131072,
        rope_scaling=scaling,
    )
    return LlamaRotaryEmbedding(cfg).inv_freq


@pytest.mark.parametrize(("ours", "theirs"), CASES, ids=["plain", "linear", "llama3"])
def test_inverse_frequencies_match_transformers(
    ours: RopeScaling, theirs: dict[str, Any] | None
) -> None:
    torch.testing.assert_close(inverse_frequencies(HEAD_DIM, BASE, ours), _hf_inv_freq(theirs))


def test_gguf_frequency_factors_divide_the_base_frequencies() -> None:
    factors = torch.linspace(1.0, 8.0, HEAD_DIM // 2)
    plain = inverse_frequencies(HEAD_DIM, BASE, RopeScaling())
    torch.testing.assert_close(
        inverse_frequencies(HEAD_DIM, BASE, RopeScaling(), factors), plain / factors
    )


def test_rotation_preserves_norms_and_is_relative() -> None:
    rot = RotaryEmbedding(HEAD_DIM, 64, inverse_frequencies(HEAD_DIM, BASE, RopeScaling()))
    q, k = torch.randn(1, 1, HEAD_DIM), torch.randn(1, 1, HEAD_DIM)

    def score(pq: int, pk: int) -> float:
        rq = rot.at(torch.tensor([pq]), q.dtype).apply(q)
        rk = rot.at(torch.tensor([pk]), k.dtype).apply(k)
        return float((rq * rk).sum())

    rq = rot.at(torch.tensor([5]), q.dtype).apply(q)
    torch.testing.assert_close(rq.norm(), q.norm())
    assert score(10, 7) == pytest.approx(score(20, 17), rel=1e-4)  # depends on distance only


def test_unknown_scaling_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="yarn"):
        inverse_frequencies(HEAD_DIM, BASE, RopeScaling(kind="yarn"))
