"""Loop owners: who steps an engine. Whoever builds an engine passes one; nothing is global.

- ``MainThreadDriver``: ``inferd serve`` runs the HTTP server on a background thread and gives
  the main thread to the engines, stepping every registered engine in turn. PyTorch's OpenMP
  intra-op parallelism only pays off on the main thread here: a step run from any other thread
  got no faster with 2 threads than with 1 (measured: SmolLM2 decode at batch 1, 16.8 ms on the
  main thread vs 24.0 ms on another; batch 16, 52 vs 88 ms; `benchmarks/threads.py`).
- ``ThreadLoop``: a daemon thread of its own, for engines embedded in other programs (the
  ``inferd.api.Engine``, ``inferd run``, tests); it ends when its last engine leaves.
- ``CallerLoop``: nobody steps the engine in the background; the caller drives the synchronous
  ``LLMEngine`` itself (``inferd.LLM``, the in-process benchmarks).

Chat engines (``AsyncEngine``) and embedding models (``EmbeddingModel``) follow the same rule:
they register with their loop when built and leave it when shut down.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol


class Steppable(Protocol):
    def run_once(self) -> bool:
        """Apply queued work and run one step if there is any; True if it did anything."""
        ...


class EngineLoop:
    """Engines registered with a loop are stepped in turn by whichever thread runs it."""

    idle_wait_seconds = 0.05

    def __init__(self) -> None:
        self.wake = threading.Event()  # set when a registered engine gets work
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

    @property
    def num_engines(self) -> int:
        with self._lock:
            return len(self._engines)

    def on_loop_thread(self) -> bool:
        """Whether the calling thread is the one that steps this loop's engines."""
        raise NotImplementedError

    def run(self, should_stop: Callable[[], bool]) -> None:
        """Step the engines until ``should_stop()``; sleeps on ``wake`` while all are idle."""
        while not should_stop():
            with self._lock:
                engines = list(self._engines)
            busy = False
            for engine in engines:
                busy |= engine.run_once()
            if not busy:
                self.wake.wait(self.idle_wait_seconds)
                self.wake.clear()


class MainThreadDriver(EngineLoop):
    """Steps its engines on the main thread: call ``run`` there (``inferd serve`` does)."""

    def on_loop_thread(self) -> bool:
        return threading.current_thread() is threading.main_thread()

    def run(self, should_stop: Callable[[], bool]) -> None:
        if not self.on_loop_thread():
            raise RuntimeError("a MainThreadDriver must run on the main thread")
        super().run(should_stop)


class ThreadLoop(EngineLoop):
    """Steps its engines on a daemon thread, started with the first engine; the thread ends
    once the last engine has left."""

    idle_wait_seconds = 0.5  # adds and shutdowns set ``wake``; the timeout is only a backstop

    def __init__(self, name: str = "inferd-engine") -> None:
        super().__init__()
        self._name = name
        self._thread: threading.Thread | None = None

    def register(self, engine: Steppable) -> None:
        with self._lock:
            self._engines.append(engine)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self.run, args=(self._empty,), name=self._name, daemon=True
                )
                self._thread.start()
        self.wake.set()

    def _empty(self) -> bool:
        """The thread's stop test: under the lock, so a concurrent register starts a new one."""
        with self._lock:
            if self._engines:
                return False
            self._thread = None
            return True

    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread


class CallerLoop(EngineLoop):
    """Nothing steps in the background: the caller steps the synchronous engine itself."""

    def on_loop_thread(self) -> bool:
        return True
