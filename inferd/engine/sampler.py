"""Sampler: logits of a batch of requests -> one token id each.

Greedy rows take the argmax. Sampled rows apply temperature, then top-k, top-p and min-p
filtering, then draw with the request's own generator so a seed reproduces the same text.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inferd.engine.request import Request


def sample(logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
    """logits: [num_requests, vocab] float32."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, request in enumerate(requests):
        if not request.params.greedy:
            tokens[row] = _sample_row(logits[row], request)
    return tokens


def _sample_row(logits: torch.Tensor, request: Request) -> int:
    p = request.params
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        probs = _top_p(probs, p.top_p)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs, 1, generator=request.generator).item())


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p."""
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
