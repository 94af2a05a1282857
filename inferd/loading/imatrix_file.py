"""llama.cpp's importance-matrix files (``llama-imatrix -o``, ``llama-quantize --imatrix``).

GGUF, llama.cpp's format (``tools/imatrix``): ``general.type = "imatrix"``, no architecture;
``imatrix.datasets`` (the calibration files' names), ``imatrix.chunk_count`` and
``imatrix.chunk_size`` (uint32); per weight tensor ``<name>.in_sum2`` (float32 [n_mat, n_in]:
the sums of squared inputs) and ``<name>.counts`` (float32 [n_mat, 1]: the tokens). More than
one matrix per tensor (n_mat > 1) are a mixture of experts' stacks (refused: inferd writes
each expert's projection as an entry of its own, under our name);
``<name>.in_sum`` (the plain sums, newer files) is not needed and not read.

Legacy ``.dat``: int32 entries; per entry int32 name length, the name, int32 ``ncall`` (chunks),
int32 n and float32[n] ``in_sum2 / count * ncall``; then int32 chunk count, int32 length and the
dataset's name. It keeps only the means: read back, a count is ``ncall * chunk_size`` (llama.cpp
guesses 512) and the sums the mean times that.

Names are llama.cpp's weight tensors (``blk.3.attn_q.weight``), mapped to ours by
loading/gguf_model.py. One of our fused projections is written once for each tensor it fuses
(q, k and v read the same inputs, so their statistics are the same, as llama.cpp's own file has
them) and read back as the mean of those entries. A module llama.cpp has no name for keeps ours.
"""

from __future__ import annotations

import math
import os
import struct
from collections import defaultdict
from pathlib import Path

import gguf
import numpy as np
import torch

from inferd.loading.gguf import GGUFError, GGUFFile
from inferd.loading.gguf_model import llama_cpp_tensors, projection_of_tensor
from inferd.loading.imatrix import Imatrix, ImatrixError

LEGACY_CHUNK_SIZE = 512  # what llama.cpp assumes of a .dat file (its default context)
_SUMS, _COUNTS = ".in_sum2", ".counts"


def write_imatrix(
    imatrix: Imatrix, path: str | os.PathLike[str], architecture: str, *, legacy: bool = False
) -> None:
    """Write ``imatrix`` as llama.cpp's GGUF file (``legacy``: its old ``.dat`` format), names
    in llama.cpp's convention for ``architecture`` (a model's ``general.architecture``). Modules
    without tokens carry nothing and are left out."""
    path = Path(path)
    entries = _file_entries(imatrix, architecture)
    if not entries:
        raise ImatrixError("the importance matrix has no tokens for any module")
    tmp = path.with_name(path.name + ".tmp")
    if legacy:
        _write_legacy(imatrix, entries, tmp)
    else:
        _write_gguf(imatrix, entries, tmp)
    os.replace(tmp, path)


def read_imatrix(
    path: str | os.PathLike[str], legacy_chunk_size: int = LEGACY_CHUNK_SIZE
) -> Imatrix:
    """Read llama.cpp's GGUF or legacy ``.dat`` importance matrix (told apart by the GGUF magic),
    keyed by our module names."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ImatrixError(f"cannot read {path}: {exc}") from exc
    if magic == b"GGUF":
        return _read_gguf(path)
    return _read_legacy(path, legacy_chunk_size)


# --- names --------------------------------------------------------------------------------------


def _file_entries(imatrix: Imatrix, architecture: str) -> dict[str, tuple[torch.Tensor, int]]:
    """llama.cpp tensor name -> (sums, count), for the modules with tokens."""
    out = {}
    for module, sums in imatrix.sums.items():
        count = imatrix.counts[module]
        if count > 0:
            for name in llama_cpp_tensors(module, architecture) or [module]:
                out[name] = (sums, count)
    return dict(sorted(out.items()))  # llama.cpp writes its entries sorted too


def _to_modules(
    entries: dict[str, tuple[torch.Tensor, float]],
    datasets: tuple[str, ...],
    chunk_count: int,
    chunk_size: int,
) -> Imatrix:
    parts: dict[str, list[tuple[torch.Tensor, float]]] = defaultdict(list)
    for name, entry in entries.items():
        parts[projection_of_tensor(name) or name].append(entry)
    sums, counts = {}, {}
    for module, found in parts.items():
        widths = {s.numel() for s, _ in found}
        if len(widths) > 1:
            raise ImatrixError(f"the entries for {module} have different sizes {sorted(widths)}")
        sums[module] = torch.stack([s for s, _ in found]).mean(0)
        counts[module] = round(sum(c for _, c in found) / len(found))
    return Imatrix(sums, counts, datasets, chunk_count, chunk_size)


# --- GGUF ---------------------------------------------------------------------------------------


class _ImatrixWriter(gguf.GGUFWriter):
    def add_architecture(self) -> None:
        """An importance matrix names no architecture (llama.cpp writes none)."""


def _write_gguf(imatrix: Imatrix, entries: dict[str, tuple[torch.Tensor, int]], path: Path) -> None:
    writer = _ImatrixWriter(str(path), arch="")
    writer.add_type(gguf.GGUFType.IMATRIX)
    writer.add_array(gguf.Keys.IMatrix.DATASETS, list(imatrix.datasets))
    writer.add_uint32(gguf.Keys.IMatrix.CHUNK_COUNT, imatrix.chunk_count)
    writer.add_uint32(gguf.Keys.IMatrix.CHUNK_SIZE, imatrix.chunk_size)
    for name, (sums, count) in entries.items():
        writer.add_tensor(name + _SUMS, sums.to(torch.float32).numpy()[None, :])
        writer.add_tensor(name + _COUNTS, np.full((1, 1), count, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _read_gguf(path: Path) -> Imatrix:
    try:
        f = GGUFFile(path)
    except GGUFError as exc:
        raise ImatrixError(str(exc)) from exc
    kind = f.get("general.type")
    if kind != gguf.GGUFType.IMATRIX:
        raise ImatrixError(f"{path} is a GGUF file but not an importance matrix ({kind=})")
    names = {info.name for info in f.tensor_infos()}
    entries: dict[str, tuple[torch.Tensor, float]] = {}
    for name in sorted(n.removesuffix(_SUMS) for n in names if n.endswith(_SUMS)):
        if name + _COUNTS not in names:
            raise ImatrixError(f"{path}: {name} has sums but no counts")
        sums, counts = f.load_tensor(name + _SUMS), f.load_tensor(name + _COUNTS)
        if counts.numel() != 1:
            raise ImatrixError(
                f"{path}: {name} holds {counts.numel()} matrices (a mixture of experts'); "
                "inferd reads one a tensor (its own files hold each expert's projection apart)"
            )
        entries[name] = (sums.reshape(-1).double(), float(counts.reshape(-1)[0]))
    if not entries:
        raise ImatrixError(f"{path} holds no importance entries")
    datasets = tuple(f.get(gguf.Keys.IMatrix.DATASETS) or ())
    chunks, size = (
        int(f.get(k, 0)) for k in (gguf.Keys.IMatrix.CHUNK_COUNT, gguf.Keys.IMatrix.CHUNK_SIZE)
    )
    return _to_modules(entries, datasets, chunks, size)


# --- legacy .dat --------------------------------------------------------------------------------


def _write_legacy(
    imatrix: Imatrix, entries: dict[str, tuple[torch.Tensor, int]], path: Path
) -> None:
    chunk = imatrix.chunk_size or LEGACY_CHUNK_SIZE
    out = [struct.pack("<i", len(entries))]
    for name, (sums, count) in entries.items():
        ncall = math.ceil(count / chunk)
        key = name.encode()
        values = (sums / count * ncall).to(torch.float32).numpy()
        out += [struct.pack("<i", len(key)), key, struct.pack("<ii", ncall, values.size)]
        out.append(values.astype("<f4").tobytes())
    dataset = (imatrix.datasets[-1] if imatrix.datasets else "").encode()
    out += [struct.pack("<ii", imatrix.chunk_count, len(dataset)), dataset]
    path.write_bytes(b"".join(out))


def _read_legacy(path: Path, chunk_size: int) -> Imatrix:
    try:
        data = _Bytes(path.read_bytes())
        entries: dict[str, tuple[torch.Tensor, float]] = {}
        n_entries = data.int32()
        if n_entries < 1:
            raise ImatrixError(f"{path} is neither a GGUF nor a legacy imatrix file")
        for _ in range(n_entries):
            name = data.text()
            ncall, n = data.int32(), data.int32()
            values = torch.from_numpy(data.floats(n).astype(np.float64))
            entries[name] = (values * chunk_size, float(ncall * chunk_size))
        chunk_count, dataset = 0, ""
        if not data.done:  # written by every llama.cpp since it added them
            chunk_count, dataset = data.int32(), data.text()
    except (struct.error, ValueError) as exc:
        raise ImatrixError(f"{path} is neither a GGUF nor a legacy imatrix file: {exc}") from exc
    return _to_modules(entries, (dataset,) if dataset else (), chunk_count, chunk_size)


class _Bytes:
    """A little-endian reader over a legacy file's bytes."""

    def __init__(self, data: bytes) -> None:
        self.data, self.offset = data, 0

    @property
    def done(self) -> bool:
        return self.offset >= len(self.data)

    def int32(self) -> int:
        (value,) = struct.unpack_from("<i", self.data, self.offset)
        self.offset += 4
        return int(value)

    def text(self) -> str:
        length = self.int32()
        raw = self._take(length)
        return raw.decode("utf-8", errors="replace")

    def floats(self, n: int) -> np.ndarray:
        return np.frombuffer(self._take(4 * n), dtype="<f4")

    def _take(self, size: int) -> bytes:
        if size < 0 or self.offset + size > len(self.data):
            raise ValueError(f"truncated at byte {self.offset}")
        raw = self.data[self.offset : self.offset + size]
        self.offset += size
        return raw
