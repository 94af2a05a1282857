"""ModelSlot and ModelRegistry: the models one server (or one application) serves, and their
lifecycle.

Each model sits in a ModelSlot with a status::

    loading ──ok──> loaded ──unload──> unloading ──drained──> unloaded ──reload──> reloading
       └──fail──> error ──reload──> reloading ──ok──> loaded ; ──fail──> error
    loaded ──requantize──> requantizing ──swapped, or refused──> loaded

Loads run one at a time on one loader thread per process, never on the event loop; callers
await them. Every model keeps its own engine thread and KV pool, so one model failing to load
(or being unloaded) leaves the others serving. Unloading drains: the slot stops admitting
requests at once, running ones may finish until a deadline, then the rest are aborted (their
streams end with an error event) and the engine shuts down.

Re-quantizing (``requantize``, ``POST /re_isq``) makes the new weights on the loader thread
while the model serves on, then drains the same way (requests arriving meanwhile wait, as for
a load) and swaps them between two engine steps; one still running at the deadline is not cut:
the swap is called off and the model serves on as it was. Calibrating (``calibrate``, ``POST
/calibration/start``) runs a text through the model between engine steps, its status staying
``loaded``; a model re-quantizes or calibrates, one at a time, never both at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum

from inferd.loading.calibration import DEFAULT_CHUNK_SIZE
from inferd.loading.imatrix import Imatrix
from inferd.loading.quantize import isq_kind
from inferd.loading.requantize import Requantized
from inferd.serving.args import DEFAULT_DRAIN_TIMEOUT
from inferd.serving.calibration import Calibration
from inferd.serving.loading import ModelKind, Servable
from inferd.serving.served import Requantization, ServedModel

log = logging.getLogger(__name__)

_POLL = 0.05  # seconds between drain checks
_ABORT_GRACE = 5.0  # seconds aborted requests get to deliver their error output


class ModelStatus(StrEnum):
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"
    UNLOADED = "unloaded"
    RELOADING = "reloading"
    REQUANTIZING = "requantizing"
    ERROR = "error"


class UnknownModelError(LookupError):
    """No model by that id (HTTP 404)."""


class ConflictError(RuntimeError):
    """A transition the model's current status does not allow (HTTP 409)."""


class UnavailableError(RuntimeError):
    """The model exists but cannot serve right now (HTTP 503)."""


@dataclass(frozen=True, slots=True)
class LoadEvent:
    """A step of a model's load, for progress callbacks."""

    model_id: str
    status: ModelStatus
    elapsed: float  # seconds since the load started
    error: str | None = None


ProgressCallback = Callable[[LoadEvent], None]


@dataclass(frozen=True, slots=True)
class UnloadReport:
    drained: int  # requests running at the unload that finished before the deadline
    aborted: int  # requests still running at the deadline, ended with an error


@dataclass(frozen=True, slots=True)
class RequantizeReport:
    change: Requantization
    drained: int  # requests running when the swap waited for them (all finished)
    seconds: float  # the whole operation: quantizing, draining, swapping


_load_order = itertools.count()  # which model loaded first, process-wide
_loader_lock = threading.Lock()
_loader: ThreadPoolExecutor | None = None


def _loader_pool() -> ThreadPoolExecutor:
    """The process's loader thread: loads run one at a time, which bounds peak memory."""
    global _loader
    with _loader_lock:
        if _loader is None:
            _loader = ThreadPoolExecutor(1, thread_name_prefix="inferd-loader")
        return _loader


@dataclass(eq=False)
class ModelSlot:
    """One served model: its id and kind, how to load it, and where it is in its lifecycle."""

    id: str
    kind: ModelKind
    load_fn: Callable[[], Servable] | None  # None: handed in loaded; cannot load again
    status: ModelStatus = ModelStatus.UNLOADED
    model: Servable | None = None
    error: str | None = None
    label: str | None = None
    load_seconds: float | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    load_order: int | None = None  # set on each successful load
    on_progress: ProgressCallback | None = field(default=None, repr=False)
    # A LoRA adapter's slot names its base model's (serving/lora.py): it serves on the base's
    # engine, so it unloads with the base and is registered again when the base loads again.
    parent: ModelSlot | None = field(default=None, repr=False)
    adapters: list[ModelSlot] = field(default_factory=list, repr=False)  # a base's adapters
    _future: Future[Servable] | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _requantizing: bool = field(default=False, repr=False)  # from the first step to the last

    @classmethod
    def of_loaded(cls, model: Servable) -> ModelSlot:
        kind: ModelKind = "embedding" if model.kind == "embedding" else "chat"
        slot = cls(model.id, kind, None, ModelStatus.LOADED, model, created=model.created)
        slot.load_order = next(_load_order)
        return slot

    def in_flight(self) -> int:
        """Requests the model is still answering."""
        model = self.model
        if model is None:
            return 0
        if isinstance(model, ServedModel):
            return _live_requests(model)
        return model.in_flight

    # -- loading ----------------------------------------------------------------------------
    def start_loading(self) -> Future[Servable]:
        """Start (or join) the load of an unloaded or failed model."""
        with self._lock:
            if self._future is not None and not self._future.done():
                return self._future
            if self.status not in (ModelStatus.UNLOADED, ModelStatus.ERROR):
                raise ConflictError(f"the model {self.id!r} is {self.status}")
            if self.load_fn is None:
                raise ConflictError(
                    f"the model {self.id!r} was handed over already loaded; there is no spec "
                    "to load it again from"
                )
            ever = self.load_seconds is not None or self.status is ModelStatus.ERROR
            self.status = ModelStatus.RELOADING if ever else ModelStatus.LOADING
            self.error = None
            future = _loader_pool().submit(self._load, self.load_fn)
            self._future = future
        self._emit(0.0)
        return future

    def _load(self, load_fn: Callable[[], Servable]) -> Servable:
        started = time.perf_counter()
        try:
            model = load_fn()
        except BaseException as exc:
            with self._lock:
                self.status = ModelStatus.ERROR
                self.error = str(exc) or type(exc).__name__
            log.error("model %s failed to load: %s", self.id, self.error)
            self._emit(time.perf_counter() - started)
            raise
        elapsed = time.perf_counter() - started
        with self._lock:
            self.model = model
            self.kind = "embedding" if model.kind == "embedding" else "chat"
            self.created = model.created
            self.load_seconds = elapsed
            if self.load_order is None:  # the first load decides the default model
                self.load_order = next(_load_order)
            self.status = ModelStatus.LOADED
        log.info("model %s loaded in %.1fs", self.id, elapsed)
        self._emit(elapsed)
        for adapter in list(self.adapters):
            adapter._load_after_base()
        return model

    def _load_after_base(self) -> None:
        """Register this adapter again on its base's new engine, now, on the loader thread
        (the base has just loaded), so a reload answers once its adapters are back. One that
        cannot be served (its files gone or changed) shows status error; the others serve.
        An adapter whose own load is queued already (the first load) is left to it."""
        with self._lock:
            if self.load_fn is None or self.status not in (ModelStatus.UNLOADED, ModelStatus.ERROR):
                return
            self.status = ModelStatus.RELOADING
            self.error = None
            future: Future[Servable] = Future()
            self._future = future
            load_fn = self.load_fn
        self._emit(0.0)
        try:
            future.set_result(self._load(load_fn))
        except Exception as exc:  # logged and shown by _load; the base and the others serve
            future.set_exception(exc)

    def _emit(self, elapsed: float) -> None:
        if self.on_progress is not None:
            try:
                self.on_progress(LoadEvent(self.id, self.status, elapsed, self.error))
            except Exception:
                log.exception("load progress callback failed")

    async def wait_loaded(self) -> Servable:
        """The model once a load in progress ends; UnavailableError if it is not loaded then."""
        future = self._future
        if future is not None and not future.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(asyncio.wrap_future(future))
        model = self.model
        if self.status is ModelStatus.LOADED and model is not None:
            return model
        if self.status is ModelStatus.ERROR:
            raise UnavailableError(f"the model {self.id!r} failed to load: {self.error}")
        raise UnavailableError(f"the model {self.id!r} is {self.status}")

    async def ensure_loaded(self, auto_reload: bool = True) -> Servable:
        """The model, waiting for a load in progress, or starting one when it is unloaded and
        ``auto_reload`` is on. UnavailableError says why not."""
        model = self.model
        if self.status is ModelStatus.LOADED and model is not None:
            return model
        parent = self.parent
        if parent is not None and parent.status is not ModelStatus.LOADED:
            await parent.ensure_loaded(auto_reload)  # its adapters load with it
            return await self.wait_loaded()
        if self.status is ModelStatus.UNLOADING:
            raise UnavailableError(f"the model {self.id!r} is being unloaded")
        if self.status is ModelStatus.ERROR:
            raise UnavailableError(
                f"the model {self.id!r} failed to load: {self.error}; POST /v1/models/reload "
                "to try again"
            )
        if self.status is ModelStatus.UNLOADED:
            if not auto_reload or self.load_fn is None:
                raise UnavailableError(
                    f"the model {self.id!r} is unloaded; POST /v1/models/reload to load it"
                )
            self.start_loading()
        return await self.wait_loaded()

    async def reload(self) -> Servable:
        """Load an unloaded (or failed) model and wait for it; ConflictError otherwise."""
        if self.status in (ModelStatus.LOADING, ModelStatus.RELOADING):
            raise ConflictError(f"the model {self.id!r} is already {self.status}")
        if self.status is ModelStatus.LOADED:
            raise ConflictError(f"the model {self.id!r} is already loaded; unload it first")
        if self.status is ModelStatus.UNLOADING:
            raise ConflictError(f"the model {self.id!r} is being unloaded; wait for it")
        parent = self.parent
        if parent is not None and parent.status is not ModelStatus.LOADED:
            raise ConflictError(
                f"the LoRA adapter {self.id!r} serves on {parent.id!r}, which is "
                f"{parent.status}; reload {parent.id!r} (its adapters come back with it)"
            )
        self.start_loading()
        return await self.wait_loaded()

    # -- re-quantizing ---------------------------------------------------------------------
    async def requantize(
        self, method: str, drain_timeout: float, imatrix: Imatrix | None = None
    ) -> RequantizeReport:
        """Quantize the model's projections again with ``method`` (q8 | q4), for ``imatrix``
        (by default the matrix the model was quantized for, if any), and serve from them
        (module doc). ConflictError, the model serving on unchanged, when it is not a loaded
        chat model, is busy re-quantizing or calibrating, cannot re-read its files, or still
        runs a request after ``drain_timeout`` seconds; QuantizeError for an unknown method."""
        started = time.perf_counter()
        isq_kind(method)  # an unknown method: QuantizeError before anything starts
        with self._lock:
            model = self._loaded_chat_model()
            self._refuse_busy(model)
            self._requantizing = True
        try:
            try:
                new = await asyncio.wrap_future(
                    _loader_pool().submit(model.prepare_requantize, method, imatrix)
                )
            except (OSError, ValueError) as exc:  # QuantizeError, ModelConfigError included
                raise ConflictError(f"cannot re-quantize {self.id!r}: {exc}") from None
            return await self._swap_drained(model, new, drain_timeout, started)
        finally:
            with self._lock:
                self._requantizing = False

    async def _swap_drained(
        self, model: ServedModel, new: Requantized, drain_timeout: float, started: float
    ) -> RequantizeReport:
        """Hold new requests (they wait, as for a load), let the running ones finish, swap."""
        with self._lock:
            if self.status is not ModelStatus.LOADED or self.model is not model:
                raise ConflictError(f"the model {self.id!r} was {self.status} meanwhile")
            self.status = ModelStatus.REQUANTIZING
            held: Future[Servable] = Future()
            self._future = held  # what ensure_loaded waits for
        adapters = [a for a in self.adapters if a.status is ModelStatus.LOADED]
        for adapter in adapters:  # they run on this engine: held too
            with adapter._lock:
                adapter.status = ModelStatus.REQUANTIZING
        try:
            running = self.in_flight()
            if not await self._drain(drain_timeout):
                raise ConflictError(
                    f"{self.in_flight()} request(s) still run on {self.id!r} after "
                    f"{drain_timeout:g}s; it was not re-quantized, try again"
                )
            try:
                change = await asyncio.wrap_future(model.swap_weights(new))
            except RuntimeError as exc:  # a request got under way, or the engine stopped
                raise ConflictError(f"cannot re-quantize {self.id!r}: {exc}") from None
        finally:
            for adapter in adapters:
                with adapter._lock:
                    if isinstance(adapter.model, ServedModel):
                        adapter.model.isq, adapter.model.imatrix = model.isq, model.imatrix
                    adapter.status = ModelStatus.LOADED
            with self._lock:
                self.status = ModelStatus.LOADED
            held.set_result(model)
        seconds = time.perf_counter() - started
        log.info("model %s re-quantized to %s in %.1fs", self.id, change.method, seconds)
        return RequantizeReport(change, running, seconds)

    def _loaded_chat_model(self) -> ServedModel:
        """The chat model this slot serves now (under the lock); ConflictError otherwise."""
        model = self.model
        if self.status is not ModelStatus.LOADED or not isinstance(model, ServedModel):
            raise ConflictError(f"the model {self.id!r} is {self.status}, not a loaded model")
        return model

    # -- calibrating ------------------------------------------------------------------------
    async def calibrate(
        self,
        text: str,
        *,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        max_chunks: int | None = None,
        dataset: str = "",
    ) -> Calibration:
        """Start the model's importance matrix from ``text`` (serving/calibration.py), the
        model serving on meanwhile; the calibration runs on, ``model.calibration`` says how
        far. ConflictError when the model is not loaded, is re-quantizing, or is calibrating
        already; ImatrixError for a chunk past its context or a text without a whole chunk."""
        with self._lock:
            model = self._loaded_chat_model()
            self._refuse_busy(model)
        calibration = await asyncio.to_thread(  # tokenizing a long text: off the event loop
            Calibration.of_text,
            model.engine.engine.model,
            model.tokenizer,
            text,
            chunk_size=chunk_size,
            max_len=model.engine.max_model_len,
            max_chunks=max_chunks,
            dataset=dataset,
        )
        with self._lock:
            if self._loaded_chat_model() is not model:
                raise ConflictError(f"the model {self.id!r} was reloaded meanwhile")
            self._refuse_busy(model)
            model.calibration = calibration
        calibration.start(model.engine)
        log.info(
            "calibrating %s: %d chunks of %d tokens",
            self.id,
            len(calibration.chunks),
            calibration.chunk_size,
        )
        return calibration

    def _refuse_busy(self, model: ServedModel) -> None:
        """ConflictError while the model is re-quantizing or calibrating (under the lock): a
        calibration's chunks must all run on one set of weights."""
        if self._requantizing:
            raise ConflictError(f"the model {self.id!r} is being re-quantized already")
        if model.calibration is not None and model.calibration.running:
            raise ConflictError(f"the model {self.id!r} is being calibrated already")

    async def _drain(self, timeout: float) -> bool:
        """Until no request runs on the model, for at most ``timeout`` seconds: whether none
        does."""
        deadline = time.monotonic() + timeout
        while self.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(_POLL)
        return not self.in_flight()

    # -- unloading --------------------------------------------------------------------------
    async def unload(self, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT) -> UnloadReport:
        """Stop admitting, let running requests finish for up to ``drain_timeout`` seconds,
        abort what is left, free the model."""
        with self._lock:
            if self.status is not ModelStatus.LOADED:
                raise ConflictError(f"the model {self.id!r} is {self.status}, not loaded")
            self.status = ModelStatus.UNLOADING
            model = self.model
        assert model is not None
        adapters = [a for a in self.adapters if a.status is ModelStatus.LOADED]
        for adapter in adapters:  # they run on this engine: no new request reaches them
            with adapter._lock:
                adapter.status = ModelStatus.UNLOADING
        running = self.in_flight()
        await self._drain(drain_timeout)
        aborted = self.in_flight()
        if aborted and isinstance(model, ServedModel):
            log.warning("unloading %s: aborting %d unfinished request(s)", self.id, aborted)
            for rid in model.engine.in_flight():
                model.engine.abort(rid)
            grace = time.monotonic() + _ABORT_GRACE
            while self.in_flight() and time.monotonic() < grace:
                await asyncio.sleep(_POLL)
        await asyncio.to_thread(model.shutdown)
        with self._lock:
            self.model = None
            self.status = ModelStatus.UNLOADED
        for adapter in adapters:
            with adapter._lock:
                adapter.model = None
                adapter.status = ModelStatus.UNLOADED
        log.info("model %s unloaded", self.id)
        return UnloadReport(drained=max(0, running - aborted), aborted=aborted)

    def shutdown(self) -> None:
        """Free the model now (no draining); for process exit."""
        future = self._future
        if future is not None and not future.done():
            future.cancel()
            with contextlib.suppress(BaseException):
                future.result()
        with self._lock:
            model, self.model = self.model, None
            if model is not None:
                self.status = ModelStatus.UNLOADED
        if model is not None:
            model.shutdown()


def _live_requests(model: ServedModel) -> int:
    return len(model.engine.in_flight())


class ModelRegistry:
    """The slots a server answers for, by API id, and the policies shared by all of them."""

    def __init__(
        self,
        slots: Sequence[ModelSlot] = (),
        *,
        default_id: str | None = None,
        auto_reload: bool = True,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
        multi: bool = False,
    ) -> None:
        self.auto_reload = auto_reload
        self.drain_timeout = drain_timeout
        self.multi = multi or len(slots) > 1  # list "default" in /v1/models
        self.slots: dict[str, ModelSlot] = {}
        for slot in slots:
            self.add(slot)
        if default_id is not None and default_id not in self.slots:
            known = ", ".join(self.slots) or "none"
            raise ValueError(f"the default model {default_id!r} is not among the models: {known}")
        self._explicit_default = default_id

    def add(self, slot: ModelSlot) -> None:
        if slot.id == "default":
            raise ValueError("'default' names the default model; it cannot be a model id")
        if slot.id in self.slots:
            raise ValueError(f"two models would be served as {slot.id!r}; give one an alias")
        self.slots[slot.id] = slot
        if slot.parent is not None and slot not in slot.parent.adapters:
            slot.parent.adapters.append(slot)

    def remove(self, model_id: str) -> ModelSlot | None:
        """Stop serving ``model_id`` (a LoRA adapter unloaded at runtime): no request reaches it,
        and its base no longer registers it when it loads again."""
        slot = self.slots.pop(model_id, None)
        if slot is not None and slot.parent is not None and slot in slot.parent.adapters:
            slot.parent.adapters.remove(slot)
        return slot

    @property
    def default_id(self) -> str | None:
        """The --default-model-id, else the first model that loaded, else the first given."""
        if self._explicit_default is not None:
            return self._explicit_default
        loaded = [s for s in self.slots.values() if s.load_order is not None]
        if loaded:
            return min(loaded, key=lambda s: s.load_order or 0).id
        return next(iter(self.slots), None)

    def all_loaded(self) -> bool:
        return bool(self.slots) and all(s.status is ModelStatus.LOADED for s in self.slots.values())

    def get(self, name: str | None) -> ModelSlot:
        """The slot for an API id, or for "default" / no name; UnknownModelError otherwise."""
        default = name in (None, "", "default")
        key = self.default_id if default else name
        slot = self.slots.get(key) if key is not None else None
        if slot is None:
            known = ", ".join(sorted(self.slots)) or "none"
            shown = "default" if default else name
            raise UnknownModelError(
                f"the model {shown!r} does not exist on this server; available: {known}"
            )
        return slot

    def load_all(self) -> None:
        """Start loading every model that is not loaded yet, in order."""
        for slot in self.slots.values():
            if slot.status is ModelStatus.UNLOADED and slot.load_fn is not None:
                slot.start_loading()

    async def wait_loads(self) -> None:
        """Until no load is in progress."""
        for slot in list(self.slots.values()):
            with contextlib.suppress(UnavailableError):
                await slot.wait_loaded()

    def shutdown(self) -> None:
        for slot in self.slots.values():
            slot.shutdown()


def registry_of(
    models: object,
    *,
    default_id: str | None = None,
    auto_reload: bool = True,
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
) -> ModelRegistry:
    """A registry from what build_app was given: a ModelRegistry (used as is), or a sequence of
    loaded models, ModelSlots and Engines (anything with a ``slot``), or one of those alone."""
    if isinstance(models, ModelRegistry):
        return models
    items = models if isinstance(models, list | tuple) else [models]
    slots = []
    for item in items:
        slot = getattr(item, "slot", item)
        if isinstance(slot, ModelSlot):
            slots.append(slot)
        elif getattr(item, "kind", None) in ("chat", "embedding"):
            slots.append(ModelSlot.of_loaded(item))  # type: ignore[arg-type]
        else:
            raise TypeError(f"cannot serve {type(item).__name__}: expected a model or an Engine")
    return ModelRegistry(
        slots, default_id=default_id, auto_reload=auto_reload, drain_timeout=drain_timeout
    )
