"""Read tensors from a .safetensors file, or a directory of them (sharded with an index or not).

Tensors are read lazily, one at a time, through the ``safetensors`` package's memory map, so a
loader holds only what it has copied so far. Names are the checkpoint's own; mapping them onto a
module is the model loader's job.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

INDEX_NAME = "model.safetensors.index.json"


class SafetensorsError(ValueError):
    """A checkpoint that cannot be read: the message names the file and what is wrong."""


class SafetensorsFile:
    """One .safetensors file."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        if not self.path.is_file():
            raise SafetensorsError(f"{self.path}: no such file")
        try:
            self._handle: Any = safe_open(str(self.path), framework="pt")
        except Exception as exc:  # the package raises its own error types
            raise SafetensorsError(f"{self.path}: not a readable safetensors file: {exc}") from None
        self._names = tuple(self._handle.keys())

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self._handle.metadata() or {})

    def names(self) -> tuple[str, ...]:
        return self._names

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def shape(self, name: str) -> tuple[int, ...]:
        self._check(name)
        return tuple(self._handle.get_slice(name).get_shape())

    def load_tensor(self, name: str) -> torch.Tensor:
        """A tensor as stored (dtype and shape), copied out of the memory map."""
        self._check(name)
        tensor: torch.Tensor = self._handle.get_tensor(name)
        return tensor.clone()

    def _check(self, name: str) -> None:
        if name not in self._names:
            raise SafetensorsError(f"{self.path}: no tensor named {name!r}")


class SafetensorsCheckpoint:
    """Every tensor of a checkpoint: a single file, or a directory with an index
    (``model.safetensors.index.json``) or with ``*.safetensors`` files and no index."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if path.is_file():
            files = [path]
        elif (path / INDEX_NAME).is_file():
            files = _indexed_files(path / INDEX_NAME)
        elif path.is_dir():
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise SafetensorsError(f"{path}: no .safetensors files in this directory")
        else:
            raise SafetensorsError(f"{path}: no such file or directory")
        self.path = path
        self.files = [SafetensorsFile(f) for f in files]
        self._where: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for name in f.names():
                if name in self._where:
                    raise SafetensorsError(
                        f"tensor {name!r} is in both {self._where[name].path.name} and "
                        f"{f.path.name}"
                    )
                self._where[name] = f

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file(name).shape(name)

    def load_tensor(self, name: str) -> torch.Tensor:
        return self._file(name).load_tensor(name)

    def _file(self, name: str) -> SafetensorsFile:
        f = self._where.get(name)
        if f is None:
            raise SafetensorsError(f"{self.path}: no tensor named {name!r}")
        return f


def _indexed_files(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SafetensorsError(f"{index}: not a safetensors index ({exc})") from None
    if not isinstance(weight_map, dict):
        raise SafetensorsError(f"{index}: weight_map must be an object")
    names = sorted(set(weight_map.values()))
    files = [index.parent / n for n in names]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise SafetensorsError(f"{index}: shards listed but missing: {', '.join(missing)}")
    return files
