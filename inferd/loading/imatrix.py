"""Importance matrices: how strongly each input column of each projection is driven.

llama.cpp's definition (``tools/imatrix``): while a model reads calibration text, each
quantizable matmul keeps, per input column j, the sum over tokens of the squared activation
``sum_t x[t, j]^2`` and the number of tokens. Their ratio, the mean square E[x_j^2], weighs an
error in weight column j: for one output, ``E[(x . (w - w_q))^2] ~ sum_j E[x_j^2] (w_j - w_q_j)^2``
when the columns are uncorrelated, so a quantizer that minimises the weighted squared error
(loading/weighted_codes.py) spends its precision where the activations are large.

``ImatrixCollector`` gathers them over a model's ``Linear`` layers (the ones ISQ quantizes,
``quantize.linear_modules``) between ``start`` and ``stop``; ``Imatrix`` is the result, keyed by
our module names (``layers.3.self_attn.qkv_proj``). loading/imatrix_file.py reads and writes
llama.cpp's files; loading/calibration.py runs a text through a model in chunks to make one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import TracebackType

import torch

from inferd.layers.linear import Linear


class ImatrixError(ValueError):
    """An importance matrix that cannot be read, written or used."""


@dataclass(frozen=True, slots=True)
class Imatrix:
    """Per projection (our module name): ``sums`` float64 [in_features], the sum over tokens of
    each input column's squared activation, and ``counts``, the tokens summed. ``datasets``,
    ``chunk_count`` and ``chunk_size`` say where they came from, as llama.cpp records them."""

    sums: Mapping[str, torch.Tensor]
    counts: Mapping[str, int]
    datasets: tuple[str, ...] = ()
    chunk_count: int = 0
    chunk_size: int = 0

    _digest: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if set(self.sums) != set(self.counts):
            raise ImatrixError("an importance matrix needs sums and a count for each module")
        object.__setattr__(self, "_digest", self._hash())  # once: cards show it on every read

    def importance(self, module: str) -> torch.Tensor | None:
        """The mean squared activation of each input column [in_features] (float32), or None
        where the matrix has no tokens for ``module``. From the sums as float32, as a file
        holds them and ``digest`` reads them: a matrix collected here and the same matrix
        read back from its file quantize alike."""
        count = self.counts.get(module, 0)
        if count <= 0:
            return None
        return self.sums[module].to(torch.float32) / count

    def digest(self) -> str:
        """sha256 of what quantization reads (each module with tokens: its name, count and sums
        as float32): the same matrix gives the same digest whichever file it came from."""
        return self._digest

    def _hash(self) -> str:
        h = hashlib.sha256()
        for module in sorted(m for m, count in self.counts.items() if count > 0):
            h.update(f"{module}\0{self.counts[module]}\0".encode())
            h.update(self.sums[module].to(torch.float32).contiguous().numpy().tobytes())
        return h.hexdigest()


@dataclass(slots=True)
class _Stats:
    sums: torch.Tensor  # float64 [in_features]
    count: int = 0


@dataclass(slots=True)
class ImatrixCollector:
    """Sums each projection's squared inputs while started (``with collector:`` starts and
    stops it). ``modules``: which (our names; by default every ``Linear`` of the model).

    The projections are called as ``layer.forward(x)`` on the model's hot path, which bypasses
    ``nn.Module`` hooks: while started, each layer gets an instance attribute ``forward`` that
    records ``x`` and then runs the class's own, and ``stop`` deletes it, so a model that is not
    being observed runs exactly the code it ran before. Every row that goes through a layer
    counts (prompt rows; decode steps run by the fused decode stack do not reach the layers).
    """

    model: torch.nn.Module
    modules: Iterable[str] | None = None
    _stats: dict[str, _Stats] = field(default_factory=dict)
    _observed: list[Linear] = field(default_factory=list)

    def start(self) -> None:
        if self._observed:
            raise ImatrixError("the collector is already started")
        wanted = None if self.modules is None else set(self.modules)
        for name, layer in self.model.named_modules():
            if isinstance(layer, Linear) and (wanted is None or name in wanted):
                stats = self._stats.setdefault(
                    name, _Stats(torch.zeros(layer.in_features, dtype=torch.float64))
                )
                layer.forward = _observing(layer, stats)  # type: ignore[method-assign,assignment]
                self._observed.append(layer)

    def stop(self) -> None:
        for layer in self._observed:
            del layer.forward
        self._observed.clear()

    def __enter__(self) -> ImatrixCollector:
        self.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def counts(self) -> dict[str, int]:
        """The tokens each observed projection has read so far."""
        return {name: s.count for name, s in self._stats.items()}

    def imatrix(
        self, datasets: tuple[str, ...] = (), chunk_count: int = 0, chunk_size: int = 0
    ) -> Imatrix:
        """What was collected so far (copies), with where it came from."""
        return Imatrix(
            {name: s.sums.clone() for name, s in self._stats.items()},
            {name: s.count for name, s in self._stats.items()},
            datasets,
            chunk_count,
            chunk_size,
        )


def _observing(layer: Linear, stats: _Stats) -> Callable[[torch.Tensor], torch.Tensor]:
    run = type(layer).forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        stats.sums += rows.float().square().sum(0, dtype=torch.float64)
        stats.count += rows.shape[0]
        return run(layer, x)

    return forward
