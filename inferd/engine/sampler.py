"""Sampler: logits of a batch of requests -> one token id each, plus logprobs when asked.

Plain greedy rows take the batched argmax and nothing else runs for them. Only rows that need
more (sampling, penalties, logit bias, logprobs) get per-row work:

1. logprobs are the log-softmax of the raw logits, before anything below (batched over the rows
   that ask for them);
2. logit bias is added, then the repetition penalty (over prompt and output tokens) and the
   frequency and presence penalties (over output tokens) are applied;
3. greedy rows take the argmax of the result; sampled rows apply temperature, then top-k, top-p
   and min-p filtering, then draw; a seeded request draws each token with a generator seeded
   by its seed and the token's position (``Request.generator_at``), so a seed reproduces the
   same text however the tokens were produced (alone, batched, speculated).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inferd.engine.outputs import TokenLogprob
from inferd.engine.request import Request
from inferd.engine.sampling import SamplingParams
from inferd.kernels.ops import KernelOps
from inferd.kernels.plain import PLAIN_OPS


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per request, in order
    logprobs: list[TokenLogprob | None]  # None where the request did not ask for logprobs


def sample(
    logits: torch.Tensor, requests: Sequence[Request], ops: KernelOps = PLAIN_OPS
) -> SamplerOutput:
    """logits: [num_requests, vocab]; ``ops``: the model's, whose ``argmax_rows`` picks the
    greedy rows' tokens."""
    tokens: list[int] = ops.argmax_rows(logits).tolist()
    logprobs: list[TokenLogprob | None] = [None] * len(tokens)
    for row, request in enumerate(requests):
        p = request.params
        if p.greedy and not p.transforms_logits:
            continue  # the batched argmax already holds its token
        row_logits = logits[row]
        if p.transforms_logits:
            row_logits = apply_logit_transforms(
                row_logits, p, request.prompt_token_ids, request.output_token_ids
            )
        tokens[row] = int(row_logits.argmax()) if p.greedy else _sample_row(row_logits, request)
    _force_thinking_close(requests, tokens)
    wanted = [row for row, r in enumerate(requests) if r.params.logprobs is not None]
    if wanted:
        _fill_logprobs(logits, requests, tokens, wanted, logprobs)
    return SamplerOutput(tokens, logprobs)


def _force_thinking_close(requests: Sequence[Request], tokens: list[int]) -> None:
    """A think block past its budget is closed whatever was sampled (engine/thinking.py).
    Not under an output constraint: its matcher decides every token, and a forced one could
    break it."""
    for row, request in enumerate(requests):
        if request.thinking is not None and request.matcher is None:
            forced = request.thinking.forced_token()
            if forced is not None:
                tokens[row] = forced


def apply_logit_transforms(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
) -> torch.Tensor:
    """One row's logits with logit bias and penalties applied, as a new float32 tensor."""
    out = logits.to(torch.float32, copy=True)
    vocab = out.shape[-1]
    if params.logit_bias:
        pairs = [(t, b) for t, b in params.logit_bias if t < vocab]
        if pairs:
            ids = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=out.device)
            bias = torch.tensor([b for _, b in pairs], dtype=torch.float32, device=out.device)
            out.index_add_(0, ids, bias)
    if params.repetition_penalty != 1.0 and (prompt_token_ids or output_token_ids):
        seen = torch.tensor(
            [*prompt_token_ids, *output_token_ids], dtype=torch.long, device=out.device
        ).unique()
        seen = seen[seen < vocab]
        values = out[seen]
        penalty = params.repetition_penalty
        out[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if (params.frequency_penalty or params.presence_penalty) and output_token_ids:
        ids = torch.tensor(output_token_ids, dtype=torch.long, device=out.device)
        counts = torch.bincount(ids, minlength=vocab)[:vocab].to(torch.float32)
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return out


def _sample_row(logits: torch.Tensor, request: Request) -> int:
    generator = request.generator_at(len(request.output_token_ids))
    return draw(sampling_probs(logits, request), generator)


def sampling_probs(logits: torch.Tensor, request: Request) -> torch.Tensor:
    """The distribution a sampled row draws from (unnormalized): temperature, then top-k,
    top-p and min-p filtering, on the device of the request's draws. Speculative
    verification (engine/speculative.py) accepts and resamples drafts against it."""
    p = request.params
    logits = logits.float()
    # Shifted so the largest logit is 0: every value is <= 0 before the division, so no
    # temperature the params allow (>= GREEDY_TEMPERATURE) can overflow it; softmax ignores shifts.
    logits = (logits - logits.max()) / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        probs = _top_p(probs, p.top_p)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    device = request.draws_on
    if device is not None and probs.device != device:
        probs = probs.to(device)
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from unnormalized ``probs`` by inverting their CDF at a uniform draw.

    The same distribution as ``torch.multinomial``, which cost ~1 ms per token over a 49k
    vocabulary here (this: ~50 us). A token of probability zero is never drawn: its CDF step
    is empty.
    """
    cdf = probs.cumsum(0)
    target = torch.rand(1, generator=generator, device=probs.device) * cdf[-1]
    index = int(torch.searchsorted(cdf, target, right=True))
    if index >= len(probs):  # u * total rounded up to the total: the last possible token
        index = int(probs.nonzero()[-1])
    return index


TOP_P_CANDIDATES = 256


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p.

    Usually the nucleus lies within the few hundred likeliest tokens: ``topk`` of those costs
    ~0.1 ms where sorting a 49k vocabulary cost ~5 ms. When their mass falls short of top_p
    (a flat distribution), the whole vocabulary is sorted.
    """
    k = min(TOP_P_CANDIDATES, probs.shape[-1])
    sorted_probs, order = probs.topk(k)
    if float(sorted_probs.sum()) < top_p:
        sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def _fill_logprobs(
    logits: torch.Tensor,
    requests: Sequence[Request],
    tokens: list[int],
    rows: list[int],
    out: list[TokenLogprob | None],
) -> None:
    """Log-softmax of the raw logits of ``rows``: the chosen token's value and the top k."""
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    chosen = torch.tensor([tokens[r] for r in rows], dtype=torch.long, device=logits.device)
    chosen_values = logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
    k = max(requests[r].params.logprobs or 0 for r in rows)
    top_values: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if k > 0:
        values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    for j, row in enumerate(rows):
        n = requests[row].params.logprobs or 0
        top = tuple(zip(top_ids[j][:n], top_values[j][:n], strict=True))
        out[row] = TokenLogprob(tokens[row], chosen_values[j], top)


def prompt_token_logprobs(
    logits: torch.Tensor, targets: Sequence[int], k: int
) -> list[TokenLogprob]:
    """Log-softmax of prompt rows: row j scores ``targets[j]``, with the top ``k`` of the row."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(targets), dtype=torch.long, device=logits.device)
    chosen: list[float] = logprobs.gather(1, ids[:, None]).squeeze(1).tolist()
    top_values: list[list[float]] = [[] for _ in chosen]
    top_ids: list[list[int]] = [[] for _ in chosen]
    if k > 0:
        values, indices = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        top_values, top_ids = values.tolist(), indices.tolist()
    return [
        TokenLogprob(t, v, tuple(zip(ti, tv, strict=True)))
        for t, v, ti, tv in zip(targets, chosen, top_ids, top_values, strict=True)
    ]
