"""Run engine steps on the process's main thread.

PyTorch's OpenMP intra-op parallelism only pays off on the main thread here: a step run from any
other thread got no faster with 2 threads than with 1 (measured: SmolLM2 decode at batch 1,
16.8 ms on the main thread vs 24.0 ms on another; batch 16, 52 vs 88 ms; `benchmarks/threads.py`).
So `inferd serve` runs the HTTP server on a background thread and gives the main thread to the
engines: while a ``MainThreadDriver`` is active, each new ``AsyncEngine`` registers with it
instead of starting a thread of its own, and the driver steps every engine in turn.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

IDLE_WAIT_SECONDS = 0.05


class Steppable(Protocol):
    def run_once(self) -> bool:
        """Apply queued adds/aborts and run one step if there is work; True if it did anything."""
        ...


class MainThreadDriver:
    def __init__(self) -> None:
        self.wake = threading.Event()
        self._engines: list[Steppable] = []
        self._lock = threading.Lock()

    def register(self, engine: Steppable) -> None:
        with self._lock:
            self._engines.append(engine)
        self.wake.set()

    def unregister(self, engine: Steppable) -> None:
        with self._lock:
            if engine in self._engines:
                self._engines.remove(engine)

    def run(self, should_stop: Callable[[], bool]) -> None:
        """Step the engines until ``should_stop()``; sleeps on ``wake`` while all are idle."""
        while not should_stop():
            with self._lock:
                engines = list(self._engines)
            busy = False
            for engine in engines:
                busy |= engine.run_once()
            if not busy:
                self.wake.wait(IDLE_WAIT_SECONDS)
                self.wake.clear()


_active: MainThreadDriver | None = None


def active_driver() -> MainThreadDriver | None:
    return _active


def activate() -> MainThreadDriver:
    """From now on, new engines are stepped by the returned driver (call ``run`` on main)."""
    global _active
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("the engine driver must be activated on the main thread")
    _active = MainThreadDriver()
    return _active


def deactivate() -> None:
    global _active
    _active = None
