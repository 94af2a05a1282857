"""`--lora NAME=PATH`: LoRA adapters served beside their base model, each under its own id.

Every adapter is read and checked before any is attached, so a bad one stops the startup with
its name in the message and leaves the model as it was. Each adapter becomes a view of the base
``ServedModel`` (``with_adapter``) on the same engine: the registry lists it, a request naming
it runs its rows with the adapter, batched with the base's and other adapters' requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from inferd.loading.lora import DEFAULT_MAX_LORA_RANK, attach, read_adapter
from inferd.serving.served import ServedModel


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


def serve_adapters(
    model: ServedModel,
    adapters: Sequence[tuple[str, Path]],
    max_rank: int = DEFAULT_MAX_LORA_RANK,
) -> list[ServedModel]:
    """Attach every adapter to ``model``'s decoder; their views, in order. Raises LoraError
    (a ValueError) naming the first adapter that cannot be served, before attaching any."""
    if max_rank < 1:
        raise ValueError(f"--max-lora-rank must be at least 1, got {max_rank}")
    for name, _ in adapters:
        if name == model.id:
            raise ValueError(f"--lora: {name!r} is the base model's own id")
    decoder = model.engine.engine.model
    read = [read_adapter(name, path, decoder, max_rank) for name, path in adapters]
    for adapter in read:
        attach(decoder, adapter)
    return [model.with_adapter(adapter.name, adapter.key) for adapter in read]
