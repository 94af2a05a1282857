"""Allowed-token masks for the constrained rows of a batch, computed while the model runs.

``MaskJob.start`` hands the matchers to a background thread before the forward pass; llguidance
computes the masks there with the GIL released, in parallel with PyTorch's forward. ``apply``
waits for them and sets every disallowed logit of those rows to -inf, so whatever the sampler
then does (greedy, temperature, top-k/p, penalties) it can only pick an allowed token.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import torch

from inferd.structured.matcher import TokenMatcher

_THREAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
_EXECUTOR: llguidance.LLExecutor | None = None
_BITS = torch.arange(32, dtype=torch.int32)


def _executor() -> llguidance.LLExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR


@dataclass(slots=True)
class MaskJob:
    rows: list[int]  # rows of the logits that are constrained
    future: concurrent.futures.Future[torch.Tensor] | None
    # Per constrained row: tokens allowed beside the grammar's (a lazy matcher's free text
    # while its trigger is half written), or None.
    extra: list[torch.Tensor | None]

    @classmethod
    def start(cls, matchers: Sequence[TokenMatcher | None], vocab_size: int) -> MaskJob:
        """Begin the masks for ``matchers`` (one per logits row, None: unconstrained)."""
        # A lazy matcher still waiting for its trigger mostly leaves its row free.
        present = [(i, m.mask_source()) for i, m in enumerate(matchers) if m is not None]
        chosen = [(i, source) for i, source in present if source is not None]
        rows = [i for i, _ in chosen]
        if not rows:
            return cls(rows, None, [])
        inners = [(source[0], j) for j, (_, source) in enumerate(chosen)]  # j: row in the masks
        future = _THREAD.submit(_fill, inners, len(rows), vocab_size)
        return cls(rows, future, [source[1] for _, source in chosen])

    def apply(self, logits: torch.Tensor) -> None:
        """Mask ``logits`` [rows, vocab] in place (waits for the masks if still running)."""
        if self.future is None:
            return
        bitmask = self.future.result()
        allowed = unpack(bitmask, logits.shape[-1])
        for j, extra in enumerate(self.extra):
            if extra is not None:
                allowed[j] |= extra[: logits.shape[-1]]
        allowed = allowed.to(logits.device)
        index = torch.tensor(self.rows, dtype=torch.long, device=logits.device)
        with torch.inference_mode():  # the logits are inference tensors
            rows = logits.index_select(0, index)
            logits.index_copy_(0, index, rows.masked_fill(~allowed, float("-inf")))


def _fill(
    matchers: list[tuple[llguidance.LLMatcher, int]], batch: int, vocab_size: int
) -> torch.Tensor:
    words = (vocab_size + 31) // 32
    bitmask = torch.zeros((batch, words), dtype=torch.int32)
    _executor().unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), words * 4, batch)
    return bitmask


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 bitmask -> [rows, vocab_size] bool, True where a token is allowed."""
    bits = (bitmask.unsqueeze(-1) >> _BITS) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
