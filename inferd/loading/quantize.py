"""In-situ quantization (``--isq q8|q4``) and quantized models kept in the store.

ISQ turns every projection of the decoder (q/k/v, o, gate/up, down; a mixture of experts' each
expert's gate/up and down, ``layers.0.mlp.experts.down_proj.3``) into a weight-only low-bit
``Linear`` that serves every batch from its packed kernel and drops the dense weight, so the
model takes about a quarter (q8) or an eighth (q4) of its float32 size in those layers:

- ``q8``: int8, symmetric, one scale per output row (``torch._weight_int8pack_mm``);
- ``q4``: int4, affine in groups of 32 input columns, ``w = q * scale + min`` with q in 0..15
  (``torch._weight_int4pack_mm_for_cpu``); shapes that kernel cannot pack (inputs not a
  multiple of 32, outputs not of 16) use q8.

The output projection (``lm_head``) uses q8 under both methods when it has its own weight (it
is the most sensitive matrix, as llama.cpp's mixes also keep it wider); when it is tied to the
embedding it stays dense and shared, which costs no memory. Embeddings and norms stay dense.

With an importance matrix (``--imatrix``, loading/imatrix.py) each group's (q4) or row's (q8)
grid is the one with the smallest importance-weighted squared error (loading/weighted_codes.py)
instead of the group's own [min, max] or the row's absolute maximum.

``inferd quantize`` writes the quantized weights to the store under
``$INFERD_HOME/quantized/<name>/`` (``model.safetensors`` with portable integer tensors, plus
``manifest.json`` naming the source digest, the method, the group size and the importance
matrix's digest, if one was used). Loading a model with ``--isq`` looks there first for an entry
of the same source, method and matrix (or none), so a restart reads the packed weights instead
of quantizing again; the source is still needed for the tokenizer, the chat template and the
unquantized rest.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from inferd.layers.linear import (
    INT4_GROUP,
    Linear,
    PackedKind,
    PackedWeight,
    int4_codes,
    int4_kernel_tensors,
    int4_packable,
    int8_codes,
)
from inferd.loading.imatrix import Imatrix
from inferd.loading.weighted_codes import int4_codes_weighted, int8_codes_weighted
from inferd.store import default_home, sha256_file

log = logging.getLogger(__name__)

ISQ_METHODS: dict[str, PackedKind] = {"q8": PackedKind.INT8, "q4": PackedKind.INT4}
MANIFEST_NAME = "manifest.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT = "inferd-isq/1"


class QuantizeError(ValueError):
    """A quantization request or a stored quantized model that cannot be used."""


def isq_kind(method: str) -> PackedKind:
    try:
        return ISQ_METHODS[method]
    except KeyError:
        raise QuantizeError(
            f"unknown in-situ quantization {method!r}; choose {', '.join(ISQ_METHODS)}"
        ) from None


# mistral.rs's ISQ names (its ``--isq`` and ``/re_isq``'s ``ggml_type``, read case-blind, as it
# reads them) that one of ours serves: the same bits per weight, not the same blocks. Its 8-bit
# types scale blocks of 32 (Q8_0, Q8_1) or 256 (Q8K); q8 scales each output row. Its 4-bit ones
# are affine groups of 32 (Q4_1, and Q4_0 a case of it) or sub-blocks of 32 with 6-bit scales
# (Q4K); q4 keeps a float scale and minimum per group of 32, as fine or finer. "8" and "4" are
# its shorthands for the best type of that width. Its other types (2, 3, 5 and 6 bits, HQQ,
# AFQ, FP8) have no kernel here.
MISTRALRS_ISQ_NAMES = {
    "8": "q8",
    "q8_0": "q8",
    "q8_1": "q8",
    "q8k": "q8",
    "4": "q4",
    "q4_0": "q4",
    "q4_1": "q4",
    "q4k": "q4",
}


def isq_method(name: str) -> str:
    """Our method (q8 | q4) for an ISQ name: ours, or one of mistral.rs's that it serves."""
    if name in ISQ_METHODS:
        return name
    method = MISTRALRS_ISQ_NAMES.get(name.lower())
    if method is None:
        as_q8 = ", ".join(n.upper() for n, m in MISTRALRS_ISQ_NAMES.items() if m == "q8")
        as_q4 = ", ".join(n.upper() for n, m in MISTRALRS_ISQ_NAMES.items() if m == "q4")
        raise QuantizeError(
            f"in-situ quantization {name[:40]!r} is not served; choose q8 or q4, or mistral.rs's "
            f"{as_q8} (served as q8) or {as_q4} (served as q4)"
        )
    return method


# --- one weight ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A weight in portable integer form (what the store keeps).

    INT8: ``q`` int8 [out, in], ``scale`` float32 [out], ``zero`` None.
    INT4: ``q`` uint8 [out, in / 2] (two 4-bit values a byte, low nibble first),
    ``scale`` and ``zero`` (the group minimum) float32 [out, in / 32].
    """

    kind: PackedKind
    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None

    def kernel_tensors(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The tensors ``Linear.use_packed_only`` takes, for activations of ``dtype``."""
        if self.kind is PackedKind.INT8:
            return self.q, self.scale.to(dtype)
        assert self.zero is not None
        return int4_kernel_tensors(self._nibbles(), self.scale, self.zero, dtype)

    def _nibbles(self) -> torch.Tensor:
        """Two codes per stored byte -> one code per input column."""
        return torch.stack((self.q & 0xF, self.q >> 4), dim=-1).reshape(self.q.shape[0], -1)

    def dequantize(self) -> torch.Tensor:
        if self.kind is PackedKind.INT8:
            return self.q.float() * self.scale[:, None]
        assert self.zero is not None
        nibbles = self._nibbles()
        groups = nibbles.float().reshape(nibbles.shape[0], -1, INT4_GROUP)
        w = groups * self.scale[..., None] + self.zero[..., None]
        return w.reshape(nibbles.shape[0], -1)


def quantize_weight(
    w: torch.Tensor, kind: PackedKind, importance: torch.Tensor | None = None
) -> QuantizedWeight:
    """[out, in] float weight -> integer form. int4 needs ``in`` a multiple of 32 and ``out`` of
    16 (the kernel's packing); other shapes get int8.

    Without ``importance``, the arithmetic of ``linear.pack_int4`` / ``pack_int8``: int4 groups
    span their own [min, max], which re-quantizes weights that came from 4-bit groups of 32 (GGML
    Q4_0/Q4_1) almost without loss; int8 is symmetric per row. ``importance`` [in] (an imatrix's
    mean squared activation of each input column) picks the grids that minimise the weighted
    squared error instead (loading/weighted_codes.py).
    """
    if importance is not None and tuple(importance.shape) != (w.shape[1],):
        raise QuantizeError(
            f"importance has shape {tuple(importance.shape)}; the weight has {w.shape[1]} inputs"
        )
    if kind is PackedKind.INT4 and int4_packable(*w.shape):
        codes, scale, lo = (
            int4_codes(w) if importance is None else int4_codes_weighted(w, importance)
        )
        pairs = codes.reshape(codes.shape[0], -1, 2)
        return QuantizedWeight(PackedKind.INT4, pairs[..., 0] | (pairs[..., 1] << 4), scale, lo)
    q8, scale = int8_codes(w) if importance is None else int8_codes_weighted(w, importance)
    return QuantizedWeight(PackedKind.INT8, q8, scale)


def kernel_form(layer: Linear, weight: QuantizedWeight) -> PackedWeight:
    """What ``layer.use_packed_only`` takes to serve ``weight`` (made without touching it)."""
    if weight.q.shape[0] != layer.out_features:
        raise QuantizeError(f"quantized weight has {weight.q.shape[0]} rows, expected {layer}")
    packed, scales = weight.kernel_tensors(torch.bfloat16)  # the kernels' fast dtype
    return weight.kind, packed, scales


def install(layer: Linear, weight: QuantizedWeight) -> None:
    """Make ``layer`` serve every batch from ``weight``; its dense weight is dropped."""
    layer.use_packed_only(*kernel_form(layer, weight))


# --- which layers, and the policy -----------------------------------------------------------------


@dataclass(slots=True)
class Isq:
    """An ISQ request while a model loads: the method, and weights already quantized (from the
    store) by module name. With ``collect``, ``quantized`` keeps every quantized weight (for
    ``save_quantized``); otherwise only the kernels' copies stay in memory. With ``imatrix``,
    each projection it has tokens for is quantized for its importance; ``weighted`` names them.
    """

    method: str
    stored: Mapping[str, QuantizedWeight] = field(default_factory=dict)
    collect: bool = False
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)
    imatrix: Imatrix | None = None
    weighted: set[str] = field(default_factory=set)

    @property
    def kind(self) -> PackedKind:
        return isq_kind(self.method)

    def kind_for(self, module: str) -> PackedKind:
        return PackedKind.INT8 if module == "lm_head" else self.kind

    def applies(self, module: str, layer: object, tied: bool) -> bool:
        """Every decoder projection, and lm_head unless it is the (dense) embedding."""
        return isinstance(layer, Linear) and not (module == "lm_head" and tied)

    def weight(self, module: str, source: torch.Tensor | None) -> QuantizedWeight:
        """The stored weight, else ``source`` (float32, before any rounding) quantized."""
        weight = self.stored.get(module)
        if weight is None:
            if source is None:
                raise QuantizeError(f"no weight for {module}")
            importance = self.imatrix.importance(module) if self.imatrix is not None else None
            if importance is not None and importance.numel() != source.shape[-1]:
                raise QuantizeError(
                    f"the importance matrix has {importance.numel()} inputs for {module}, which "
                    f"takes {source.shape[-1]}: it was made for another model"
                )
            weight = quantize_weight(source, self.kind_for(module), importance)
            if importance is not None:
                self.weighted.add(module)
        if self.collect:
            self.quantized[module] = weight
        return weight

    def apply(self, module: str, layer: Linear, source: torch.Tensor | None) -> None:
        """Install ``weight(module, source)`` in ``layer``."""
        install(layer, self.weight(module, source))


def linear_modules(model: torch.nn.Module) -> Iterator[tuple[str, Linear]]:
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            yield name, module


# --- the store ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QuantizedManifest:
    format: str
    name: str
    source_name: str
    source_digest: str
    method: str
    group_size: int
    architecture: str
    files: dict[str, str]  # relpath -> sha256
    created: float
    imatrix: str | None = None  # the importance matrix's digest (Imatrix.digest), if one was used


def quantized_home(home: Path | None = None) -> Path:
    return (home or default_home()) / "quantized"


def entry_name(source_name: str, method: str, imatrix: str | None = None) -> str:
    """The entry's folder: ``<source>-<method>``, and ``-imatrix-<digest prefix>`` when an
    importance matrix was used (the same method with and without one are two entries)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in source_name)
    return f"{safe}-{method}" + (f"-imatrix-{imatrix[:12]}" if imatrix is not None else "")


def list_quantized(home: Path | None = None) -> list[tuple[Path, QuantizedManifest]]:
    root = quantized_home(home)
    out = []
    for manifest in sorted(root.glob(f"*/{MANIFEST_NAME}")) if root.is_dir() else []:
        try:
            out.append((manifest.parent, QuantizedManifest(**json.loads(manifest.read_text()))))
        except (OSError, ValueError, TypeError):
            log.warning("ignoring unreadable quantized manifest %s", manifest)
    return out


def find_quantized(
    source_digest: str, method: str, home: Path | None = None, imatrix: str | None = None
) -> tuple[Path, QuantizedManifest] | None:
    """The entry of this source and method made with the importance matrix of digest
    ``imatrix`` (None: made without one)."""
    for path, manifest in list_quantized(home):
        if (manifest.source_digest, manifest.method, manifest.imatrix) == (
            source_digest,
            method,
            imatrix,
        ):
            return path, manifest
    return None


def save_quantized(
    weights: Mapping[str, QuantizedWeight],
    *,
    source_name: str,
    source_digest: str,
    method: str,
    architecture: str,
    home: Path | None = None,
    imatrix: str | None = None,
) -> tuple[Path, QuantizedManifest]:
    """Write ``weights`` (module name -> quantized weight) into the store; returns the entry.
    ``imatrix``: the digest of the importance matrix they were quantized with."""
    from safetensors.torch import save_file

    name = entry_name(source_name, method, imatrix)
    folder = quantized_home(home) / name
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for module, w in weights.items():
        tensors[f"{module}.q"] = w.q.contiguous()
        tensors[f"{module}.scale"] = w.scale.contiguous()
        if w.zero is not None:
            tensors[f"{module}.zero"] = w.zero.contiguous()
    tmp = folder / (WEIGHTS_NAME + ".tmp")
    kinds = {m: w.kind.value for m, w in weights.items()}
    save_file(tensors, str(tmp), metadata={"format": FORMAT, "kinds": json.dumps(kinds)})
    os.replace(tmp, folder / WEIGHTS_NAME)
    manifest = QuantizedManifest(
        format=FORMAT,
        name=name,
        source_name=source_name,
        source_digest=source_digest,
        method=method,
        group_size=INT4_GROUP if isq_kind(method) is PackedKind.INT4 else 0,
        architecture=architecture,
        files={WEIGHTS_NAME: sha256_file(folder / WEIGHTS_NAME)},
        created=time.time(),
        imatrix=imatrix,
    )
    text = json.dumps(asdict(manifest), indent=2)
    (folder / (MANIFEST_NAME + ".tmp")).write_text(text)
    os.replace(folder / (MANIFEST_NAME + ".tmp"), folder / MANIFEST_NAME)
    return folder, manifest


def load_quantized(folder: Path, manifest: QuantizedManifest) -> dict[str, QuantizedWeight]:
    """The stored weights, digest-verified."""
    from safetensors import safe_open

    if manifest.format != FORMAT:
        raise QuantizeError(f"{folder}: unknown quantized format {manifest.format!r}")
    for rel, digest in manifest.files.items():
        path = folder / rel
        if not path.is_file() or sha256_file(path) != digest:
            raise QuantizeError(f"{path}: missing or its sha256 does not match the manifest")
    with safe_open(str(folder / WEIGHTS_NAME), framework="pt") as f:
        kinds: dict[str, str] = json.loads((f.metadata() or {})["kinds"])
        out = {}
        for module, kind in kinds.items():
            zero = f.get_tensor(f"{module}.zero") if kind == PackedKind.INT4.value else None
            out[module] = QuantizedWeight(
                PackedKind(kind), f.get_tensor(f"{module}.q"), f.get_tensor(f"{module}.scale"), zero
            )
    return out


def isq_for(
    method: str | None,
    source_digest: str,
    home: Path | None = None,
    imatrix: Imatrix | None = None,
) -> Isq | None:
    """The ISQ request for a load (with ``imatrix``, if given): with the stored weights when
    the store has them, made with the same matrix (or none)."""
    if method is None:
        if imatrix is not None:
            raise QuantizeError("an importance matrix goes with in-situ quantization (--isq)")
        return None
    isq_kind(method)  # validate
    digest = imatrix.digest() if imatrix is not None else None
    found = find_quantized(source_digest, method, home, digest)
    if found is None:
        return Isq(method, imatrix=imatrix)
    folder, manifest = found
    log.info("using quantized weights from %s (%s)", folder, method)
    return Isq(method, stored=load_quantized(folder, manifest), imatrix=imatrix)
