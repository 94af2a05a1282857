"""The encoder cache: an image encoder's output kept by the image's digest, so that the same
image in another request (a follow-up turn, a retry, ``n`` choices) is not encoded again, and a
prompt prefilled in several chunks encodes its image once.

Least recently used entries go first when the byte budget (``--encoder-cache-mb``) is exceeded;
an output larger than the whole budget is used once and not kept. Keys are content digests of
the media, so two requests share an entry only when they sent the same bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class EncoderCacheStats:
    hits: int = 0
    misses: int = 0  # encoder runs
    evictions: int = 0


class EncoderCache:
    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError("the encoder cache budget cannot be negative")
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self.stats = EncoderCacheStats()
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, digest: str) -> bool:
        return digest in self._entries

    def get(self, digest: str) -> torch.Tensor | None:
        value = self._entries.get(digest)
        if value is None:
            return None
        self._entries.move_to_end(digest)
        self.stats.hits += 1
        return value

    def clear(self) -> None:
        """Forget every entry (the encoder's weights changed; the counters stay)."""
        self._entries.clear()
        self.used_bytes = 0

    def put(self, digest: str, value: torch.Tensor) -> None:
        """Keep ``value`` (counted as a miss: it was just computed) if it fits the budget."""
        self.stats.misses += 1
        size = value.numel() * value.element_size()
        if size > self.budget_bytes or digest in self._entries:
            return
        while self.used_bytes + size > self.budget_bytes:
            _, old = self._entries.popitem(last=False)
            self.used_bytes -= old.numel() * old.element_size()
            self.stats.evictions += 1
        self._entries[digest] = value
        self.used_bytes += size
