"""`--lora NAME=PATH`: LoRA adapters served beside their base model, each under its own id.

Every adapter is read and checked before any is registered, so a bad one stops the startup with
its name in the message and leaves the model as it was. Each adapter becomes a view of the base
``ServedModel`` (``with_adapter``) on the same engine: the registry lists it, a request naming
it runs its rows with the adapter, batched with the base's and other adapters' requests.

Registering does not attach: the engine's ``LoraSlots`` (engine/lora_slots.py, ``--max-loras``)
asks this module's ``AdapterLibrary`` to read an adapter from its files and attach it when a
request needs it, and to detach it when its slot goes to another. Reading again checks the
files' digest against the one registered, so an adapter always runs the weights it was
registered with (its rows and prefix-cache entries are named by that digest).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from inferd.loading.lora import (
    DEFAULT_MAX_LORA_RANK,
    LoraAdapter,
    LoraError,
    attach,
    detach,
    read_adapter,
)
from inferd.models.llama import LlamaForCausalLM
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
            raise LoraError(
                f"LoRA adapter {entry.name!r} ({entry.path}): its files changed since it was "
                "loaded; load the new files under another name"
            )
        attach(self.model, adapter)

    def unload(self, key: str) -> None:
        detach(self.model, key)


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
    library = library_of(model)
    for adapter in read:
        library.register(adapter, max_rank)  # its weights are read again when first needed
    return [model.with_adapter(adapter.name, adapter.key) for adapter in read]


def withdraw_adapter(view: ServedModel) -> None:
    """Stop serving the adapter of ``view`` (no request may run it any more): forget it and
    detach it if resident."""
    assert view.lora is not None
    slots = view.engine.engine.adapters
    slots.forget(view.lora)
    if isinstance(slots.loader, AdapterLibrary):
        slots.loader.remove(view.lora)
