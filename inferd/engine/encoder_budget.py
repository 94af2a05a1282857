"""The encoder's share of a scheduling step: how much media a step may encode.

The token budget (``max_num_batched_tokens``) bounds the rows the language model runs in a step,
and an image's placeholders count there like any token. But the first chunk that holds an image
also runs the image's encoder, whose cost the token budget does not see: one request with ten
large images would encode all ten in one step and every decode in the batch would wait for it.
So a step also has an encoder budget, in encoder output rows (one per placeholder token, so the
same unit as the token budget; ``max_encoder_tokens``, by default the token budget).

- Media the encoder cache holds, or that another chunk of this step already encodes, cost
  nothing: the runner reads their rows from the cache.
- A chunk that would start media past the budget stops just before their first placeholder;
  the rest of the prompt continues in a later step.
- Media larger than the whole budget still run, alone: when nothing else is encoded in the step.
  Without this rule such a request would never progress.
- Once a request is cut short by the budget, no later request starts encoding in that step
  (``close``), so media requests keep their order and a stream of small images cannot starve a
  large one. Requests that need no encoding still run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from inferd.engine.request import MediaInput, Request


@dataclass(slots=True)
class EncoderBudget:
    left: int  # encoder rows this step may still take
    is_cached: Callable[[str], bool]  # whether the encoder cache holds a digest's rows
    planned: set[str] = field(default_factory=set)  # digests this step already encodes
    started: bool = False  # whether any media is encoded this step (or the budget is closed)

    def fit(self, request: Request, start: int, n: int) -> int:
        """How many of the ``n`` tokens from ``start`` the step can take: all of them, or the
        tokens before the first medium that must be encoded and no longer fits."""
        left, started = self.left, self.started
        for m in self._to_encode(request, start, start + n):
            cost = len(m.positions)
            if started and cost > left:
                return max(m.positions[0] - start, 0)
            left, started = max(left - cost, 0), True
        return n

    def charge(self, request: Request, start: int, n: int) -> None:
        """Record that the chunk of ``n`` tokens from ``start`` (as ``fit`` allowed) runs."""
        for m in self._to_encode(request, start, start + n):
            self.left = max(self.left - len(m.positions), 0)
            self.started = True
            self.planned.add(m.digest)

    @property
    def exhausted(self) -> bool:
        """Whether no further media may start encoding in this step."""
        return self.started and self.left == 0

    def close(self) -> None:
        """No further media start encoding in this step."""
        self.left, self.started = 0, True

    def _to_encode(self, request: Request, start: int, end: int) -> list[MediaInput]:
        """The request's media within ``[start, end)`` that the step would encode, in order."""
        media = [
            m
            for m in request.media
            if m.overlaps(start, end)
            and m.digest not in self.planned
            and not self.is_cached(m.digest)
        ]
        # the same digest twice in one prompt is encoded once
        unique = {m.digest: m for m in reversed(media)}
        return sorted(unique.values(), key=lambda m: m.positions[0])
