"""A process-wide budget of decoded image pixels: requests with images wait their turn here.

An image of W x H pixels takes at least 3 * W * H bytes once decoded (more while Pillow turns
it upright and into RGB), and a request's decoded images live until its prompt is built. Each
request asks for the pixels of all its images at once, from their headers, before decoding
any (all at once so two requests never each hold part and wait for the rest); each image's
share comes back when its decoded pixels are freed (a finalizer on the Pillow image, so the
budget follows the memory wherever the image is kept), and the share of an image never
decoded (a failure part way) comes back at once.

A request over the whole budget can never run: a 400 (``media_too_large``). One that must
wait waits, first come first served, for at most ``wait_seconds``, then gets a 503 with
``Retry-After``: waiting is right for a burst (decoded images are freed within seconds), the
bound keeps a stuck queue from holding connections forever, and 503 (not 429) because it is
the server's memory that is short, not the client's rate.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field

from inferd.host_memory import release_free_heap_soon
from inferd.server.defaults import DEFAULT_MAX_DECODED_PIXELS
from inferd.server.errors import APIError, bad_request

DEFAULT_WAIT_SECONDS = 60.0


@dataclass(slots=True)
class _Waiter:
    pixels: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]


@dataclass(slots=True)
class PixelBudget:
    capacity: int = DEFAULT_MAX_DECODED_PIXELS
    wait_seconds: float = DEFAULT_WAIT_SECONDS
    used: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _waiters: deque[_Waiter] = field(default_factory=deque, repr=False)

    def __reduce__(self) -> tuple[type[PixelBudget], tuple[int, float]]:
        """Sent to another process (a Ray replica's settings) as its limits alone: each process
        keeps its own budget, with its own lock and no one waiting."""
        return PixelBudget, (self.capacity, self.wait_seconds)

    async def acquire(self, pixels: int, param: str = "messages") -> None:
        """Take ``pixels`` of the budget, waiting while others hold it (APIError 400 when it
        can never fit, 503 after ``wait_seconds``)."""
        if pixels > self.capacity:
            raise bad_request(
                f"{param}: the request's images hold {pixels} pixels; this server decodes at "
                f"most {self.capacity} at once (--max-decoded-pixels)",
                param,
                code="media_too_large",
            )
        loop = asyncio.get_running_loop()
        with self._lock:
            if not self._waiters and self.used + pixels <= self.capacity:
                self.used += pixels
                return
            waiter = _Waiter(pixels, loop, loop.create_future())
            self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), self.wait_seconds)
        except (TimeoutError, asyncio.CancelledError) as exc:
            with self._lock:
                granted = waiter not in self._waiters
                if not granted:
                    self._waiters.remove(waiter)
            if granted:  # granted as the wait ended: give it back
                self.release(pixels)
            else:
                self._grant()  # the head may have been all that blocked the others
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise APIError(
                503,
                "the server is decoding as many image pixels as it holds at once "
                "(--max-decoded-pixels); retry shortly",
                param,
                "server_busy",
                headers={"Retry-After": "1"},
            ) from None

    def release(self, pixels: int) -> None:
        """Give ``pixels`` back (from any thread: finalizers run where the last reference
        goes) and wake the waiters that now fit, in order."""
        with self._lock:
            self.used -= pixels
        self._grant()

    def release_when_freed(self, obj: object, pixels: int) -> None:
        """Give ``pixels`` back once ``obj`` (a decoded image) is garbage, and its memory to
        the OS (glibc would keep it in the decoding thread's arena)."""
        weakref.finalize(obj, self._freed, pixels)

    def _freed(self, pixels: int) -> None:
        self.release(pixels)
        release_free_heap_soon()

    def _grant(self) -> None:
        with self._lock:
            while self._waiters and self.used + self._waiters[0].pixels <= self.capacity:
                waiter = self._waiters.popleft()
                self.used += waiter.pixels
                waiter.loop.call_soon_threadsafe(_resolve, waiter.future)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
