"""Allowed-token masks for the constrained rows of a batch, computed while the model runs.

``MaskJob.start`` hands the matchers to a background thread before the forward pass; llguidance
computes the masks there with the GIL released, in parallel with PyTorch's forward. ``apply``
waits for them and sets every disallowed logit of those rows to -inf, so whatever the sampler
then does (greedy, temperature, top-k/p, penalties) it can only pick an allowed token.

A request with speculative drafts has a row per draft after its own: row ``i`` gets the mask
after the drafts before it. llguidance advances the matcher over them and rolls it back, in the
same background job; a lazy matcher still waiting for its trigger (whose drafts never complete
one) gives each row's mask from the output's end after the drafts before it. Rows after a
draft the mask refuses (rare: drafts were cut where the constraint refuses them, but a mask
also leaves out non-canonical tokenizations the constraint would take) may allow nothing;
verification never reaches them, as that draft is rejected.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import torch

from inferd.structured.matcher import TokenMatcher, unpack

_THREAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
_EXECUTOR: llguidance.LLExecutor | None = None

# One request's part of a step's logits: its matcher (None: free) and its drafts (one more row
# each after its own).
MaskEntry = tuple[TokenMatcher | None, Sequence[int]]


def _executor() -> llguidance.LLExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR


@dataclass(slots=True)
class MaskJob:
    rows: list[int]  # rows of the logits that are constrained, ascending
    future: concurrent.futures.Future[torch.Tensor] | None
    # Per constrained row: tokens allowed beside the grammar's (a lazy matcher's free text
    # while its trigger is half written), or None.
    extra: list[torch.Tensor | None]

    @classmethod
    def start(cls, entries: Sequence[MaskEntry], vocab_size: int) -> MaskJob:
        """Begin the masks of a step's logits rows: one entry per request that samples, in
        row order, each covering its own row and one per draft."""
        rows: list[int] = []
        extra: list[torch.Tensor | None] = []
        plain: list[tuple[llguidance.LLMatcher, int]] = []
        drafted: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
        row = 0
        for matcher, draft in entries:
            sources = None if matcher is None or not draft else matcher.row_sources(draft)
            if sources is not None:  # rows masked one by one (a lazy matcher still waiting)
                for i, each in enumerate(sources):
                    if each is not None:
                        plain.append((each[0], len(rows)))
                        rows.append(row + i)
                        extra.append(each[1])
                row += 1 + len(draft)
                continue
            # A lazy matcher still waiting for its trigger mostly leaves its row free.
            source = None if matcher is None else matcher.mask_source()
            if source is not None:
                j = len(rows)  # its first row in the masks
                rows.extend(range(row, row + 1 + len(draft)))
                extra.extend([source[1], *[None] * len(draft)])
                if draft:
                    assert source[1] is None  # drafts only where the grammar is the whole mask
                    drafted.append((source[0], j, list(draft)))
                else:
                    plain.append((source[0], j))
            row += 1 + len(draft)
        if not rows:
            return cls(rows, None, [])
        return cls(rows, _THREAD.submit(_fill, plain, drafted, len(rows), vocab_size), extra)

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
    plain: list[tuple[llguidance.LLMatcher, int]],
    drafted: list[tuple[llguidance.LLMatcher, int, list[int]]],
    batch: int,
    vocab_size: int,
) -> torch.Tensor:
    words = (vocab_size + 31) // 32
    bitmask = torch.zeros((batch, words), dtype=torch.int32)
    executor = _executor()
    if plain:
        executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), words * 4, batch)
    if drafted:
        # Each matcher's row j, then j + 1 + i after draft i; the matcher is rolled back.
        executor.unsafe_compute_mask_ptr_with_draft_token(
            drafted, bitmask.data_ptr(), words * 4, batch
        )
    return bitmask
