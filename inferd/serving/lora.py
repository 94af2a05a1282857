"""`--lora NAME=PATH`: LoRA adapters served beside their base model, each under its own id.

Every adapter is read and checked before any is registered, so a bad one stops the startup with
its name in the message and leaves the model as it was. Each adapter becomes a view of the base
``ServedModel`` (``with_adapter``) on the same engine: the registry lists it, a request naming
it runs its rows with the adapter, batched with the base's and other adapters' requests.

Registering does not attach: the engine's ``LoraSlots`` (engine/lora_slots.py, ``--max-loras``)
asks this module's ``AdapterLibrary`` to read an adapter from its files and attach it when a
request needs it, and to detach it when its slot goes to another. Reading again checks the
files' digest against the one registered, so an adapter always runs the weights it was
registered with (its rows and prefix-cache entries are named by that digest). Files changed
since fail the request with ``AdapterChangedError``, which the server answers with a 409 that
says how to serve the new files.

Each adapter has its own ``ModelSlot`` whose ``parent`` is its base's (``adapter_slot``): when
the base model is loaded again (POST /v1/models/reload, or a request with auto-reload on),
every adapter is registered again on the new engine from the same files, digest checked, so
they come back under the same names; one whose files are gone or changed shows status error.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from inferd.engine.lora_slots import AdapterChangedError
from inferd.loading.lora import (
    DEFAULT_MAX_LORA_RANK,
    LoraAdapter,
    LoraError,
    attach,
    check_name,
    detach,
    read_adapter,
)
from inferd.models.llama import LlamaForCausalLM
from inferd.serving.loading import ModelLoadError
from inferd.serving.registry import ModelSlot, ModelStatus
from inferd.serving.served import ServedModel

log = logging.getLogger(__name__)
_library_lock = threading.Lock()  # two runtime loads must not give one engine two libraries


def parse_lora_flags(values: Sequence[str]) -> list[tuple[str, Path]]:
    """``NAME=PATH`` flags -> (name, path); ValueError for a malformed or repeated name."""
    out: list[tuple[str, Path]] = []
    for value in values:
        name, sep, path = value.partition("=")
        name = name.strip()
        if not sep or not name or not path:
            raise ValueError(f"--lora {value!r}: expected NAME=PATH")
        if name == "default":
            raise ValueError("--lora: 'default' names the default model; choose another name")
        check_name(name)
        if any(name == seen for seen, _ in out):
            raise ValueError(f"--lora: the name {name!r} is given twice")
        out.append((name, Path(path).expanduser()))
    return out


@dataclass(frozen=True, slots=True)
class RegisteredAdapter:
    """What is needed to read an adapter again: where, checked how, and which digest."""

    name: str
    path: Path
    max_rank: int
    digest: str


class AdapterLibrary:
    """The adapters registered on one decoder, by key; the engine's ``AdapterLoader``."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.adapters: dict[str, RegisteredAdapter] = {}

    def register(self, adapter: LoraAdapter, max_rank: int) -> None:
        entry = RegisteredAdapter(adapter.name, adapter.path, max_rank, adapter.digest)
        self.adapters[adapter.key] = entry

    def remove(self, key: str) -> None:
        self.adapters.pop(key, None)

    def load(self, key: str) -> None:
        entry = self.adapters.get(key)
        if entry is None:
            raise LoraError(f"LoRA adapter {key} is not registered (unloaded?)")
        adapter = read_adapter(entry.name, entry.path, self.model, entry.max_rank)
        if adapter.digest != entry.digest:
            raise AdapterChangedError(changed_message(entry.name, entry.path))
        attach(self.model, adapter)

    def unload(self, key: str) -> None:
        detach(self.model, key)


def changed_message(name: str, path: Path) -> str:
    """Why adapter ``name`` cannot be served any more, and what to do about it."""
    return (
        f"LoRA adapter {name!r} changed on disk since it was loaded ({path}); to serve the "
        f"new files, POST /v1/unload_lora_adapter then /v1/load_lora_adapter with {name!r} again"
    )


def library_of(model: ServedModel) -> AdapterLibrary:
    """The adapter library of ``model``'s engine, made on first use."""
    slots = model.engine.engine.adapters
    with _library_lock:
        if not isinstance(slots.loader, AdapterLibrary):
            slots.loader = AdapterLibrary(model.engine.engine.model)
        return slots.loader


def serve_adapters(
    model: ServedModel,
    adapters: Sequence[tuple[str, Path]],
    max_rank: int = DEFAULT_MAX_LORA_RANK,
) -> list[ServedModel]:
    """Register every adapter on ``model``'s engine; their views, in order. Raises LoraError
    (a ValueError) naming the first adapter that cannot be served, before registering any."""
    if max_rank < 1:
        raise ValueError(f"--max-lora-rank must be at least 1, got {max_rank}")
    for name, _ in adapters:
        if name == model.id:
            raise ValueError(f"--lora: {name!r} is the base model's own id")
    decoder = model.engine.engine.model
    read = [read_adapter(name, path, decoder, max_rank) for name, path in adapters]
    return [_register(model, adapter, max_rank) for adapter in read]


def _register(model: ServedModel, adapter: LoraAdapter, max_rank: int) -> ServedModel:
    library_of(model).register(adapter, max_rank)  # its weights are read again when first needed
    return model.with_adapter(adapter.name, adapter.key)


@dataclass(slots=True)
class AdapterSource:
    """An adapter slot's ``load_fn``: registers the adapter on its base slot's current engine
    (the base has just loaded, or loaded again). The first registration pins the files'
    digest; a later one whose files differ fails, so a name always stands for the weights it
    was loaded with."""

    base: ModelSlot
    name: str
    path: Path
    max_rank: int
    digest: str | None = None

    def __call__(self) -> ServedModel:
        model = self.base.model
        if self.base.status is not ModelStatus.LOADED or not isinstance(model, ServedModel):
            why = f": {self.base.error}" if self.base.error else ""
            raise ModelLoadError(f"its base model {self.base.id!r} is {self.base.status}{why}")
        try:
            adapter = read_adapter(self.name, self.path, model.engine.engine.model, self.max_rank)
        except ValueError as exc:  # LoraError included: it names the adapter and the reason
            raise ModelLoadError(str(exc)) from None
        if self.digest is not None and adapter.digest != self.digest:
            raise ModelLoadError(changed_message(self.name, self.path))
        self.digest = adapter.digest
        return _register(model, adapter, self.max_rank)


def adapter_slot(
    base: ModelSlot, name: str, path: Path, max_rank: int, view: ServedModel | None = None
) -> ModelSlot:
    """The slot serving adapter ``name`` on ``base``: loaded with ``view`` (registered by
    ``serve_adapters`` already), or to load once its base has."""
    source = AdapterSource(base, name, path, max_rank)
    if view is None:
        return ModelSlot(name, "chat", source, label=_label(base, name), parent=base)
    assert view.lora is not None
    source.digest = library_of(view).adapters[view.lora].digest
    slot = ModelSlot.of_loaded(view)
    slot.load_fn, slot.parent, slot.label = source, base, _label(base, name)
    return slot


def _label(base: ModelSlot, name: str) -> str | None:
    return f"{base.label}.lora.{name}" if base.label is not None else None


def withdraw_adapter(view: ServedModel) -> None:
    """Stop serving the adapter of ``view`` (no request may run it any more): forget it and
    detach it if resident."""
    assert view.lora is not None
    slots = view.engine.engine.adapters
    slots.forget(view.lora)
    if isinstance(slots.loader, AdapterLibrary):
        slots.loader.remove(view.lora)
