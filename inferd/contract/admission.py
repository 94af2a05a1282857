"""Product-side admission: a weighted permit taken before a request reaches the server.

The server's ``--max-seqs`` caps sequences it runs at once, but counts a 20-token question and
a 4,000-token document with eight images alike, and queued requests still hold sockets,
memory and deadlines. A product takes a permit weighted by what the request will cost
(``request_weight``: its prompt, estimated from the body, its media and its output budget)
from a bounded pool before sending, and gives it back only when the run has ended, the
connection closed included (seed 000: keep the accounting until termination is confirmed).
The server's own cap stays as the second layer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from inferd.contract.request import ChatRequest

BYTES_PER_TOKEN = 4  # a prompt's body bytes per token, a cheap upper-side estimate for text
MEDIA_TOKENS = 1024  # what one image, audio clip or video is counted as, before its size is known


class PermitRefused(Exception):
    """The pool cannot take this request: too heavy for it, too many waiting, or the wait ran
    out. Answer the caller 429/503 rather than queue without bound."""


def request_weight(
    request: ChatRequest,
    *,
    bytes_per_token: int = BYTES_PER_TOKEN,
    media_tokens: int = MEDIA_TOKENS,
) -> int:
    """Tokens the request may cost the server: its body as prompt, each media part, and its
    whole output budget."""
    prompt = -(-len(request.body) // bytes_per_token)
    return prompt + media_tokens * len(request.artifact_digests) + request.max_tokens


class AdmissionPool:
    """At most ``capacity`` weight admitted at once, at most ``max_waiting`` callers waiting.
    Waiters are served in arrival order, so a heavy request is not starved by light ones."""

    def __init__(self, capacity: int, max_waiting: int = 64) -> None:
        if capacity < 1 or max_waiting < 0:
            raise ValueError("capacity must be at least 1 and max_waiting not negative")
        self.capacity = capacity
        self.max_waiting = max_waiting
        self._in_use = 0
        self._turns: list[object] = []  # the waiters' tickets, in arrival order
        self._changed = threading.Condition()

    @property
    def in_use(self) -> int:
        with self._changed:
            return self._in_use

    @contextmanager
    def permit(self, weight: int, timeout: float) -> Iterator[int]:
        """Hold ``weight`` of the pool for the block (the request, to the connection's close)."""
        self._acquire(weight, timeout)
        try:
            yield weight
        finally:
            with self._changed:
                self._in_use -= weight
                self._changed.notify_all()

    def _acquire(self, weight: int, timeout: float) -> None:
        if not 1 <= weight <= self.capacity:
            raise PermitRefused(
                f"a request of weight {weight} can never fit a pool of {self.capacity}"
            )
        deadline = time.monotonic() + timeout
        ticket = object()
        with self._changed:
            queued = len(self._turns)
            if queued >= self.max_waiting and (queued or not self._fits_now(weight)):
                raise PermitRefused(f"{queued} requests already wait for a permit")
            self._turns.append(ticket)
            try:
                while not (self._turns[0] is ticket and self._fits_now(weight)):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise PermitRefused(f"no permit of weight {weight} within {timeout:g}s")
                    self._changed.wait(left)
                self._in_use += weight
            finally:
                self._turns.remove(ticket)
                self._changed.notify_all()

    def _fits_now(self, weight: int) -> bool:
        return self._in_use + weight <= self.capacity
