"""Which LoRA adapters are resident in the model's weights (``--max-loras``), decided by the
scheduler as it admits requests.

At most ``capacity`` adapters are attached to the decoder at once. A waiting request whose
adapter is resident is admitted as any other; one whose adapter is not gets it loaded into a
free slot, or into the slot of the least recently used resident adapter that no running request
uses (evicted). When every slot is held by running requests the request stays queued, keeping
its place, until one of them finishes. Loading and evicting run on the stepping thread between
two steps, so no forward ever sees an adapter half attached.

Eviction never changes an adapter's output: the loader reads the same files again (it checks
their digest), and rows and prefix-cache entries name the adapter by ``name@digest``, so cached
blocks stay valid across an eviction. What reading and attaching is, is the loader's business
(serving/lora.py): the engine sees keys only.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol

from inferd.config import EngineConfig

log = logging.getLogger(__name__)

DEFAULT_MAX_LORAS = EngineConfig().max_loras


class AdapterLoader(Protocol):
    """Attaches and detaches adapters by key (serving/lora.py's ``AdapterLibrary``)."""

    def load(self, key: str) -> None:
        """Attach adapter ``key`` to the decoder; raises (with a message naming it) if it
        cannot be, e.g. it was unloaded or its files changed."""

    def unload(self, key: str) -> None:
        """Detach adapter ``key`` from the decoder."""


class AdapterChangedError(RuntimeError):
    """Raised by a loader: the adapter's files on disk are no longer the ones registered under
    its key (its name stands for those weights only), so it cannot be loaded again."""


ADAPTER_CHANGED = "lora_adapter_changed"  # the files changed on disk since registration
ADAPTER_UNAVAILABLE = "lora_adapter_unavailable"  # any other failure to read or attach it


class AdapterLoadError(RuntimeError):
    """A request's adapter could not be made resident; the request fails with this message and
    ``code`` (``ADAPTER_CHANGED`` or ``ADAPTER_UNAVAILABLE``), which the server turns into a
    4xx/503 answer rather than an engine failure."""

    def __init__(self, message: str, code: str = ADAPTER_UNAVAILABLE) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class LoraSlots:
    """The resident adapters, least recently used first, and the loads and evictions so far.
    Without a ``loader`` nothing is managed: rows run whatever is attached (tests, embedders
    attaching by hand)."""

    capacity: int = DEFAULT_MAX_LORAS
    loader: AdapterLoader | None = None
    resident: OrderedDict[str, None] = field(default_factory=OrderedDict)
    loads: int = 0
    evictions: int = 0
    # admit (stepping thread) and forget (an admin route's thread) both change ``resident``
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.capacity}")

    def admit(self, key: str, in_use: Collection[str]) -> bool:
        """Make ``key`` resident for a request about to run; False when every slot is held by
        an adapter in ``in_use`` (the running requests'), so the request must wait. Raises
        AdapterLoadError when the loader cannot load it."""
        if self.loader is None:
            return True
        with self._lock:
            if key in self.resident:
                self.resident.move_to_end(key)
                return True
            victim = None
            if len(self.resident) >= self.capacity:
                victim = next((k for k in self.resident if k not in in_use), None)
                if victim is None:
                    return False
                self.loader.unload(victim)
                del self.resident[victim]
                self.evictions += 1
            try:
                self.loader.load(key)
            except Exception as exc:
                changed = isinstance(exc, AdapterChangedError)
                code = ADAPTER_CHANGED if changed else ADAPTER_UNAVAILABLE
                raise AdapterLoadError(str(exc), code) from exc
            self.resident[key] = None
            self.loads += 1
        evicted = f", evicted {victim}" if victim is not None else ""
        log.info(
            "LoRA %s loaded (%d of %d slots used%s; %d loads, %d evictions so far)",
            key,
            len(self.resident),
            self.capacity,
            evicted,
            self.loads,
            self.evictions,
        )
        return True

    def forget(self, key: str) -> None:
        """``key`` will not be asked for again (unloaded at runtime): detach it if resident."""
        if self.loader is None:
            return
        with self._lock:
            if key in self.resident:
                self.loader.unload(key)
                del self.resident[key]
