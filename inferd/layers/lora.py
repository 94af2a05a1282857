"""LoRA adapters applied inside the linear projections, many adapters in one batch.

A ``Linear`` with adapters attached carries a ``LoraSlot``: for each adapter, the low-rank
updates ``x @ A^T @ B^T * scale`` it adds to output columns ``[start, start + out)`` (a fused
projection such as QKV holds up to three, one per target). The runner says which rows run which
adapter (``lora_rows``, once a step); each projection then gathers the rows of each adapter
present, computes its update on them alone and adds it back (vLLM's punica idea without its
kernels: on a CPU a gather and two thin matmuls per adapter cost little next to the base
matmul). Rows of the base model (no adapter) are untouched, and a ``Linear`` without a slot
pays one attribute check.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class LoraDelta:
    """One low-rank update on output columns ``[start, start + b.shape[0])``."""

    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank]
    scale: float
    start: int


@dataclass(frozen=True, slots=True)
class LoraRows:
    """A step's rows grouped by adapter: (adapter name, row indices) for each adapter present."""

    groups: tuple[tuple[str, torch.Tensor], ...]


_rows: ContextVar[LoraRows | None] = ContextVar("lora_rows", default=None)


@contextmanager
def lora_rows(adapters: Sequence[str | None]) -> Iterator[None]:
    """Run row ``i`` with adapter ``adapters[i]`` (None: the base model) inside this block."""
    by_name: dict[str, list[int]] = {}
    for row, name in enumerate(adapters):
        if name is not None:
            by_name.setdefault(name, []).append(row)
    groups = tuple((n, torch.tensor(r, dtype=torch.long)) for n, r in by_name.items())
    token = _rows.set(LoraRows(groups) if groups else None)
    try:
        yield
    finally:
        _rows.reset(token)


def adapters_active() -> bool:
    """Whether some row of the running step has an adapter (``lora_rows``)."""
    return _rows.get() is not None


@dataclass(frozen=True, slots=True)
class _Merged:
    """An adapter's updates on one projection as one pair of matmuls: the A matrices stacked,
    the scaled B matrices block-diagonal over the output columns ``[start, end)`` they cover
    (a fused QKV update is then two matmuls, not six)."""

    a: torch.Tensor  # [sum of ranks, in]
    b: torch.Tensor  # [end - start, sum of ranks]
    start: int
    end: int


def _merge(deltas: Sequence[LoraDelta]) -> _Merged:
    start = min(d.start for d in deltas)
    end = max(d.start + d.b.shape[0] for d in deltas)
    # float32 whatever the model's dtype: these thin matmuls ran ~2x faster than bf16 on an
    # AVX-512 CPU without AMX (one thread, [4, 576] x [576, 48]), and round less.
    a = torch.cat([d.a for d in deltas]).float()
    b = torch.zeros(end - start, a.shape[0])
    col = 0
    for d in deltas:
        rank, first = d.a.shape[0], d.start - start
        b[first : first + d.b.shape[0], col : col + rank] = d.b.float() * d.scale
        col += rank
    return _Merged(a, b, start, end)


@dataclass(slots=True)
class LoraSlot:
    """The adapters' updates on one projection, by adapter name (change it through ``put`` and
    ``pop``, which keep the merged form in step)."""

    deltas: dict[str, list[LoraDelta]] = field(default_factory=dict)
    _merged: dict[str, _Merged] = field(default_factory=dict)

    def put(self, name: str, delta: LoraDelta) -> None:
        """Add one update of adapter ``name``."""
        self.deltas.setdefault(name, []).append(delta)
        self._merged[name] = _merge(self.deltas[name])

    def pop(self, name: str) -> None:
        self.deltas.pop(name, None)
        self._merged.pop(name, None)

    def apply(self, x: torch.Tensor, out: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """``out`` (the base projection of ``x``) plus each row's adapter update, in place.
        ``invariant`` (under ``dense_rows``): a row's update has the same bits whatever other
        rows run with its adapter (a lone row would take another matmul kernel: padded)."""
        batch = _rows.get()
        if batch is None:
            return out
        for name, rows in batch.groups:
            m = self._merged.get(name)
            if m is None:
                continue
            xs = x.index_select(0, rows).float()
            lone = invariant and xs.shape[0] == 1
            if lone:
                xs = torch.cat((xs, torch.zeros_like(xs)))
            update = (xs @ m.a.T) @ m.b.T
            update = update[:1] if lone else update
            out[:, m.start : m.end].index_add_(0, rows, update.to(out.dtype))
        return out
