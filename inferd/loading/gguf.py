"""Read GGUF model files: metadata as plain Python values, tensors as float32 torch tensors.

A thin layer over ``gguf.GGUFReader`` (gguf-py), which memory-maps the file and parses its
header. Tensor data stays in the mapping until ``load_tensor`` dequantizes it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderField, ReaderTensor

from inferd.loading.dequant import Int4Groups, dequantize, int4_groups

__all__ = ["GGUFError", "GGUFFile", "GGUFTensorInfo", "GGUFTensorNotFound", "Transform"]

# How a tensor read from a file (given with its name) becomes the one a model holds: a
# converter's change undone.
Transform = Callable[[torch.Tensor, str], torch.Tensor]


class GGUFError(ValueError):
    """A GGUF file is missing, malformed, or lacks something asked of it."""


class GGUFTensorNotFound(GGUFError, KeyError):
    """``load_tensor`` was asked for a tensor the file does not contain."""

    def __str__(self) -> str:
        # KeyError would show the message repr()-quoted.
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    """A tensor's name, storage type, and shape in torch (row-major) order."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]


class _Reader(GGUFReader):
    """GGUFReader, about 3x faster to open on files with large vocabularies.

    GGUFReader parses the header with one tiny slice of its ``np.memmap`` per value (two per
    string, so ~200k for a 49k-token vocabulary plus merges). Slicing a ``memmap`` subclass
    runs its Python-level ``__array_finalize__``/``__getitem__`` each time, which dominates
    the open time. Slicing a plain ndarray view of the same mapping is identical otherwise.
    ``_get`` is a private method of the pinned gguf version; the tests compare this reader's
    fields and tensors against the stock one.
    """

    _plain: npt.NDArray[np.uint8] | None = None

    def _get(
        self,
        offset: int,
        dtype: npt.DTypeLike,
        count: int = 1,
        override_order: Literal["I", "S", "<"] | None = None,
    ) -> npt.NDArray[Any]:
        if self._plain is None:
            self._plain = self.data.view(np.ndarray)
        count = int(count)
        dt = np.dtype(dtype)
        arr = self._plain[offset : offset + dt.itemsize * count].view(dt)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))


def _field_value(field: ReaderField) -> Any:
    """Decode one metadata field to plain Python (str, int, float, bool, or a list of them).

    ``contents()`` decodes a 49k-string array in ~40 ms; numpy scalars become Python values
    through ``tolist()``. FLOAT32 values widen to Python floats (1e-5 reads 9.9999997e-06).
    """
    try:
        return field.contents()
    except UnicodeDecodeError as exc:
        raise GGUFError(f"metadata field {field.name!r} holds invalid UTF-8: {exc}") from exc


class GGUFFile:
    """An opened GGUF file: decoded metadata plus lazily dequantized tensors."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"GGUF file not found: {self.path}")
        try:
            self._reader = _Reader(self.path)
        except OSError as exc:  # e.g. permission denied
            raise GGUFError(f"cannot read GGUF file {self.path}: {exc}") from exc
        except (ValueError, IndexError, KeyError, OverflowError) as exc:
            # Bad magic, unknown version or value type, empty or truncated file: gguf and
            # numpy report these with whatever error the parse happened to hit.
            raise GGUFError(f"{self.path} is not a valid GGUF file: {exc}") from exc
        self.metadata: dict[str, Any] = {
            name: _field_value(field)
            for name, field in self._reader.fields.items()
            if not name.startswith("GGUF.")  # version/tensor_count/kv_count header fields
        }
        self._tensors: dict[str, ReaderTensor] = {t.name: t for t in self._reader.tensors}

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r})"

    def get(self, key: str, default: Any = None) -> Any:
        """Return metadata value ``key``, or ``default`` when absent."""
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        """The ``general.architecture`` key, e.g. ``"llama"``."""
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path} has no general.architecture metadata")
        return arch

    def tensor_infos(self) -> list[GGUFTensorInfo]:
        """All tensors in file order, with torch-order shapes."""
        return [_info(t) for t in self._tensors.values()]

    def load_tensor(self, name: str) -> torch.Tensor:
        """Dequantize tensor ``name`` into a new contiguous float32 tensor."""
        tensor = self._tensor(name)
        return dequantize(tensor.data, tensor.tensor_type, _info(tensor).shape)

    def load_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of 2-D tensor ``name``, dequantized to float32: a big tensor
        read piece by piece never has its whole float32 copy in memory."""
        raw, qtype, cols = self._rows(name, start, stop)
        return dequantize(raw, qtype, (stop - start, cols))

    def load_int4_rows(self, name: str, start: int, stop: int) -> Int4Groups:
        """Rows ``[start, stop)`` of a 4-bit tensor (``INT4_GROUP_TYPES``) as affine groups of
        32: codes, scales and mins exactly as its blocks hold them (``dequant.int4_groups``)."""
        raw, qtype, cols = self._rows(name, start, stop)
        return int4_groups(raw, qtype, (stop - start, cols))

    def _rows(
        self, name: str, start: int, stop: int
    ) -> tuple[npt.NDArray[np.uint8], GGMLQuantizationType, int]:
        tensor = self._tensor(name)
        info = _info(tensor)
        if len(info.shape) != 2 or not 0 <= start <= stop <= info.shape[0]:
            raise GGUFError(f"tensor {name!r} of shape {info.shape} has no rows {start}:{stop}")
        row_bytes = tensor.n_bytes // info.shape[0]
        # Read, not memory-mapped: pages of a mapping stay in this process's RSS until it is
        # unmapped, so mapping a whole 8B file would make loading look bigger than serving.
        raw = np.empty((stop - start) * row_bytes, dtype=np.uint8)
        with self.path.open("rb", buffering=0) as f:
            f.seek(tensor.data_offset + start * row_bytes)
            if f.readinto(raw.data) != raw.nbytes:
                raise GGUFError(f"{self.path} ends inside tensor {name!r}")
        return raw, info.qtype, info.shape[1]

    def _tensor(self, name: str) -> ReaderTensor:
        tensor = self._tensors.get(name)
        if tensor is None:
            raise GGUFTensorNotFound(f"tensor {name!r} not found in {self.path}")
        if self._reader.byte_order != "I" and tensor.tensor_type not in _ENDIAN_SAFE:
            # Block formats embed multi-byte scales that would need per-type byte swapping.
            raise GGUFError(
                f"tensor {name!r}: {tensor.tensor_type.name} data in a byte-swapped "
                f"(big-endian) GGUF file is not supported"
            )
        return tensor


# Types whose data GGUFReader exposes with a byte-order-aware numpy dtype.
_ENDIAN_SAFE = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16})


def _info(tensor: ReaderTensor) -> GGUFTensorInfo:
    # GGUF lists dimensions fastest-varying first; torch wants them slowest first.
    shape = tuple(int(dim) for dim in reversed(tensor.shape.tolist()))
    return GGUFTensorInfo(tensor.name, GGMLQuantizationType(tensor.tensor_type), shape)
