"""Linear layers that switch kernels with the batch size.

On a CPU a decode step of a few tokens is bound by reading the weights, so a weight-only int4 or
int8 kernel (a half or a quarter of the bytes of bf16) wins; with more rows the matmul becomes
compute-bound and the dense bf16 kernel wins again (measured in benchmarks/kernels.py). A
``Linear`` therefore keeps its dense weight and may carry a packed low-bit copy that serves
batches of at most ``small_batch`` rows.

int4 packing is affine per group of 32 input columns: ``w = q * scale + min`` with ``q`` in
0..15. That is exactly GGML's Q4_1 layout (and holds Q4_0 with ``min = -8 * scale``), so weights
that came from such blocks are repacked without further loss.

Batches past ``small_batch`` run the dense bf16 weight, except where packed weights take the
VNNI kernels (bf16 models on the AVX-512 VNNI build, unless ``INFERD_INT4_INT8=0``;
``PackedKind.INT4_VNNI``/``INT8_VNNI``, ``pack_int4_vnni``/``pack_int8_vnni``): each row is
quantized to int8 per group of 32 on the way in (a scale per group, llama.cpp's Q8_1) and meets
the int4 codes (or int8 ones, symmetric per group of 32 as Q8_0) through ``vpdpbusd``, 64
multiplies an instruction against the bf16 one's 32, from weights read as 4 or 8 bits. They
then serve every decode batch up to ``INT4_INT8_ROWS`` (int4 on SmolLM2, one thread, 30
layers of each projection: 1.4-2.5x the oneDNN bf16 weight at 16-64 rows, 1.3-2.7x torch's int4
kernel at 1-8 rows; benchmarks/int4_int8.py), and a 16-row decode step's projections took 19 ms
instead of 33 (benchmarks/step_profile.md). The int8 rows cost some accuracy, as they do in
llama.cpp; the int8 weights' group scales win some back over one scale per output row (SmolLM2:
mean KL to float32 0.0036 against 0.0021 with bf16 rows; Gemma 3, whose Q4_K/Q6_K layers are
int8 here, 0.0114 against 0.0184; benchmarks/accuracy.py). An earlier int8 x int8 path
(fbgemm's kernel, one scale per row, 9..32 rows) was slower than the oneDNN-packed dense weight
below at every size (SmolLM2, 2 cores: a 16-row step 37.3 vs 33.3 ms) and was removed.

The dense bf16 weight is kept a second time in oneDNN's blocked layout (``OneDnnWeight``), made
on first use: ``F.linear`` reorders the weight into that layout on every call, which cost SmolLM2
~40% of its gate/up projection and ~40% of its output head at 16 rows; the packed call runs the
same kernel on the same blocks and gives the same bits. It costs a copy of the dense weights,
so the copies together stay within a share of the free RAM (``PackBudget``).

Each kernel alone is batch-invariant (a row's output bits do not depend on the other rows), but
the choice between them is not, so a step with prompt rows runs every row dense
(``dense_rows``): a prompt's logits then do not depend on how it was chunked or on how much of
it the prefix cache held (README: "Determinism").
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

from inferd import kernels
from inferd.host_memory import HugePageArena, available_bytes, release_free_heap
from inferd.kernels.plain import unpack_vnni
from inferd.layers.kernel_user import KernelUser
from inferd.layers.lora import LoraSlot
from inferd.layers.registered import Registered

INT4_GROUP = 32
VNNI_TILE = 16  # outputs per tile of the int4 x int8 kernel's layout (pack_int4_vnni)
DEFAULT_SMALL_BATCH = 8

_dense_rows: ContextVar[bool] = ContextVar("dense_rows", default=False)
_packed_rows: ContextVar[bool] = ContextVar("packed_rows", default=False)


@contextmanager
def dense_rows(active: bool = True) -> Iterator[None]:
    """Every row through the dense weight inside this block, whatever the batch size.

    The dense kernel (oneDNN bf16; a lone row padded to two, ``_invariant_dense``) gives a row
    the same bits whatever rows run beside it (tests/layers/test_linear.py checks it); switching
    kernels with the batch size is what changes a row's numerics. Prompt rows run here, so a
    prompt's logits do not depend on its chunking or on a prefix-cache hit; ``--deterministic``
    runs every row here.
    """
    token = _dense_rows.set(active)
    try:
        yield
    finally:
        _dense_rows.reset(token)


@contextmanager
def packed_rows() -> Iterator[None]:
    """Every row through the packed low-bit copy inside this block (where a layer has one),
    past ``small_batch`` rows too.

    The weight-only kernels give a row the same bits whatever rows run beside it, so the rows
    of a speculative verify step (engine/speculative.py) get the logits a plain one-row decode
    would have had (without the VNNI kernels, the int8 output head's lone row aside: its one-row
    kernel rounds differently, as at any batch size) and greedy text stays that of decoding
    without drafts; the dense bf16 weight would round every row otherwise (its weights are the
    packed ones rounded to bf16). The VNNI kernels serve such rows anyway (up to
    ``INT4_INT8_ROWS``); without them, torch's int4 kernel past 8 rows costs more per row than
    dense (SmolLM2, one sequence: 16 rows 40 ms against 26-31), still less per token than 8-row
    steps.
    """
    token = _packed_rows.set(True)
    try:
        yield
    finally:
        _packed_rows.reset(token)


def packed_decode(rows: int, max_rows: int) -> bool:
    """Whether a step of ``rows`` rows runs every layer's packed copy, as a layer whose copy
    serves up to ``max_rows`` rows would pick it: neither ``dense_rows`` nor past the copy's
    rows outside ``packed_rows`` (``Linear._base``)."""
    return not _dense_rows.get() and (rows <= max_rows or _packed_rows.get())


class PackedKind(enum.Enum):
    INT4 = "int4"  # torch's CPU int4 pack (bf16 activations)
    INT4_ROWS = "int4_rows"  # inferd's row layout for float32 models (``pack_int4_rows``)
    INT8 = "int8"
    INT4_VNNI = "int4_vnni"  # int4 codes x int8 activations (``pack_int4_vnni``), bf16 models
    INT8_VNNI = "int8_vnni"  # int8 codes x int8 activations (``pack_int8_vnni``), bf16 models


# The kinds whose kernels quantize the rows to int8 on the way in (VNNI layouts).
VNNI_KINDS = (PackedKind.INT4_VNNI, PackedKind.INT8_VNNI)


# A projection's packed copy as ``Linear.use_packed_only`` takes it: kind, codes, scales.
PackedWeight = tuple[PackedKind, torch.Tensor, torch.Tensor]


# Decode batches up to here run the int4 x int8 kernel where a layer has it: it beat oneDNN's
# dense bf16 at every size measured, 1 to 256 rows (benchmarks/int4_int8.py).
INT4_INT8_ROWS = 256


class Linear(nn.Linear, KernelUser):
    """``nn.Linear`` (no bias unless asked) with an optional low-bit kernel for small batches.

    After ``use_packed_only`` (in-situ quantization) the packed kernel serves every batch and
    the dense weight is gone (an empty tensor that only remembers the dtype).
    """

    # Read on every call: straight from the registry (layers/registered.py)
    weight = Registered[torch.Tensor]("_parameters")
    bias = Registered[nn.Parameter]("_parameters")  # None where there is none, as nn.Linear

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed_kind: PackedKind | None = None
        self.small_batch = DEFAULT_SMALL_BATCH
        self._packed: torch.Tensor | None = None
        self._scales: torch.Tensor | None = None
        self._onednn = OneDnnWeight()  # the dense weight in oneDNN's layout (bf16 only)
        self.lora: LoraSlot | None = None  # adapters' low-rank updates (layers/lora.py)

    def pack(
        self,
        kind: PackedKind,
        source: torch.Tensor | None = None,
        small_batch: int = DEFAULT_SMALL_BATCH,
    ) -> None:
        """Add the low-bit copy; ``source`` is the float32 weight before any bf16 rounding."""
        w = (source if source is not None else self.weight.detach()).float()
        if w.shape[1] % INT4_GROUP == 0 and kernels.int8_dot(self.weight.dtype):
            # The VNNI kernels beat the weight-only ones at small batches and the dense weight
            # up to INT4_INT8_ROWS: they serve them all.
            vnni, pack = (
                (PackedKind.INT4_VNNI, pack_int4_vnni)
                if kind is PackedKind.INT4
                else (PackedKind.INT8_VNNI, pack_int8_vnni)
            )
            self._packed, self._scales = pack(w)
            self.packed_kind, self.small_batch = vnni, max(small_batch, INT4_INT8_ROWS)
            return
        if kind is PackedKind.INT4 and self.weight.dtype == torch.float32 and w.shape[1] % 32 == 0:
            # torch's int4 kernel is ~10x slower than dense with float32 activations (AVX2
            # machines, whose models run float32): inferd's kernel takes its own layout.
            kind = PackedKind.INT4_ROWS
            self._packed, self._scales = pack_int4_rows(w)
        elif kind is PackedKind.INT4 and int4_packable(w.shape[0], w.shape[1]):
            self._packed, self._scales = pack_int4(w, self.weight.dtype)
        else:
            kind = PackedKind.INT8
            self._packed, self._scales = pack_int8(w, self.weight.dtype)
        self.packed_kind = kind
        self.small_batch = small_batch

    def use_packed_only(self, kind: PackedKind, packed: torch.Tensor, scales: torch.Tensor) -> None:
        """Serve every batch from these kernel tensors (``pack_int4``/``pack_int8`` output) and
        free the dense weight: weight-only quantization that saves memory."""
        self._packed, self._scales, self.packed_kind = packed, scales, kind
        self.small_batch = sys.maxsize
        self._onednn = OneDnnWeight()
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    @property
    def dense(self) -> bool:
        """Whether the dense weight is still held (False after ``use_packed_only``)."""
        return self.weight.numel() > 0

    def vnni_parts(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """The VNNI copy (codes, scales, bits of a code) for a caller running its kernel itself
        (``models/decode_stack.py``), or None where the layer has none."""
        if self.packed_kind not in VNNI_KINDS or self._packed is None or self._scales is None:
            return None
        return self._packed, self._scales, 4 if self.packed_kind is PackedKind.INT4_VNNI else 8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._base(x)
        lora = self.lora  # read once: an admin route may detach the last adapter meanwhile
        return out if lora is None else lora.apply(x, out, _dense_rows.get())

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        # The context variable first: decode steps seldom run dense rows, and ``dense`` is a
        # property that reads the weight.
        if _dense_rows.get() and self.dense:
            return _invariant_dense(x, self._dense_linear)
        if self._packed is not None and (rows <= self.small_batch or _packed_rows.get()):
            return self._weight_only(x)
        return self._dense_linear(x)

    def _dense_linear(self, x: torch.Tensor) -> torch.Tensor:
        """``F.linear`` on the dense weight: through its oneDNN-packed copy where one can be made
        (module doc: the same bits, less time)."""
        packed = self._onednn.get(self.weight, x) if self.bias is None and x.shape[0] > 1 else None
        if packed is None:
            return F.linear(x, self.weight, self.bias)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return out

    def _weight_only(self, x: torch.Tensor) -> torch.Tensor:
        assert self._packed is not None and self._scales is not None
        if self.packed_kind in VNNI_KINDS:  # takes float32 and bf16 rows as they are
            vnni = (
                self.ops.int4_vnni_linear
                if self.packed_kind is PackedKind.INT4_VNNI
                else self.ops.int8_vnni_linear
            )
            out = vnni(x, self._packed, self._scales, self.out_features)
            return out if self.bias is None else out + self.bias
        # The kernels are fast in bf16 only: float32 activations visit bf16 (ISQ in f32 models).
        xk = x if x.dtype == self._scales.dtype else x.to(self._scales.dtype)
        if self.packed_kind is PackedKind.INT4:
            out = self.ops.int4_linear(xk, self._packed, self._scales, INT4_GROUP)
        elif self.packed_kind is PackedKind.INT4_ROWS:
            out = self.ops.int4_rows_linear(xk, self._packed, self._scales)
        elif xk.shape[0] == 1 and _dense_rows.get():
            # ISQ q8 under dense_rows: one row would take the fused GEMV, another kernel than
            # the one of two rows and more (nothing bounds its order of sums to match), so a
            # lone row runs beside a zero row.
            pair = torch.cat((xk, torch.zeros_like(xk)))
            out = self.ops.int8_linear(pair, self._packed, self._scales)[:1]
        else:
            out = self.ops.int8_linear(xk, self._packed, self._scales)
        if out.dtype != x.dtype:  # a no-op ``to`` still costs a dispatch (~2 us)
            out = out.to(x.dtype)
        return out if self.bias is None else out + self.bias


def packed_on_huge_pages(model: nn.Module) -> None:
    """Every layer's packed copy (codes and scales) moved side by side into one huge-page
    buffer (``host_memory.HugePageArena``: a decode step reads them all), each original
    dropped as its copy is placed. Skipped where the arena would take more than a quarter of
    the free RAM."""
    layers = [
        m
        for m in model.modules()
        if isinstance(m, Linear) and m._packed is not None and m._scales is not None
    ]
    sizes = [
        t.numel() * t.element_size()
        for m in layers
        for t in (m._packed, m._scales)
        if t is not None
    ]
    if not sizes or sum(sizes) > available_bytes() // 4:
        return
    arena = HugePageArena(sizes)
    for m in layers:
        assert m._packed is not None and m._scales is not None
        m._packed = arena.place(m._packed)
        m._scales = arena.place(m._scales)
        release_free_heap()  # the originals' pages now, so that the copy never doubles RSS


def resident_bytes(model: nn.Module) -> int:
    """The bytes a model's weights take in RAM: parameters, buffers and packed copies, each
    storage counted once (a tied head shares the embedding's; meta tensors take none)."""
    tensors = [*model.parameters(), *model.buffers()]
    for m in model.modules():
        if isinstance(m, Linear):
            tensors += [t for t in (m._packed, m._scales) if t is not None]
    seen: dict[int, int] = {}
    for t in tensors:
        if t.device.type != "meta" and t.numel():
            seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.numel() * t.element_size())
    return sum(seen.values())


def _invariant_dense(
    x: torch.Tensor, linear: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``linear`` (the dense ``F.linear``) whose row results do not depend on the number of rows.

    oneDNN's bf16 matmul gives a row the same bits for every batch of 2 rows or more, but a lone
    row takes a matrix-vector kernel that sums long rows (1536 inputs: SmolLM2's down projection)
    in another order, about one time in ten; so a lone row runs beside a zero row.
    """
    if x.shape[0] != 1:
        return linear(x)
    return linear(torch.cat((x, torch.zeros_like(x))))[:1]


# The batch size oneDNN is told to expect when it packs a weight: a batched decode's. The packed
# layout serves every batch size (and gives every one the same bits as F.linear).
ONEDNN_PACK_ROWS = 16


class OneDnnWeight:
    """A bf16 dense weight reordered once into oneDNN's blocked layout.

    ``F.linear`` in bf16 hands the weight to oneDNN, which reorders it into its blocked layout
    on every call: for SmolLM2's gate/up projection at 16 rows that copy is ~40% of the call
    (benchmarks/step_profile.md). Packed once, the same kernel runs on the same blocks and gives
    the same bits (tests/layers/test_linear.py checks it against ``F.linear``), so this is only
    a cache: it is remade when the weight tensor or its contents change (LoRA never touches the
    base weight; ``use_packed_only`` drops it). float32 weights go to MKL's sgemm, not oneDNN,
    and are left alone; so are weights that need gradients, layers with a bias (where F.linear
    adds it its own way) and lone rows (F.linear may take a matrix-vector kernel for them).
    """

    __slots__ = ("_budget", "_bytes", "_key", "_packed")

    def __init__(self) -> None:
        self._key: tuple[int, int] | None = None
        self._packed: torch.Tensor | None = None
        self._budget: PackBudget | None = None  # what the copy's bytes were taken from
        self._bytes = 0

    def get(self, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        # Every call checks what may change between calls; the weight's device and shape are
        # checked when it is packed (~3 us of checks, ~120 calls a decode step).
        if not _takes_rows(weight, x):
            return None
        key = (weight.data_ptr(), weight._version)
        if key != self._key:
            if not _onednn_packable(weight, x):
                return None
            self._release()
            size = weight.numel() * weight.element_size()
            budget = PACK_BUDGET
            if not budget.take(size):
                return None  # F.linear: slower, but no second copy where RAM is short
            self._packed = torch.ops.mkldnn._reorder_linear_weight(
                weight.detach(), ONEDNN_PACK_ROWS
            )
            self._key, self._budget, self._bytes = key, budget, size
        return self._packed

    def _release(self) -> None:
        if self._budget is not None:
            self._budget.give_back(self._bytes)
        self._key, self._packed, self._budget, self._bytes = None, None, None, 0

    def __del__(self) -> None:
        self._release()


class PackBudget:
    """The bytes that packed copies of dense weights may take, process-wide.

    Each copy doubles its weight's memory: worth it for a small model, ruinous for one whose
    weights fill the machine (a 7B model in bf16 on 24 GiB). So copies together take at most a
    share of the RAM the OS could give when the first was made (after the weights and the KV
    pool are in); layers past the budget keep calling ``F.linear`` (same bits, slower)."""

    def __init__(self, share: float) -> None:
        self.share = share
        self.remaining: int | None = None  # set at the first copy

    def take(self, size: int) -> bool:
        if self.remaining is None:
            self.remaining = int(self.share * available_bytes())
        if size > self.remaining:
            return False
        self.remaining -= size
        return True

    def give_back(self, size: int) -> None:
        if self.remaining is not None:
            self.remaining += size


PACK_BUDGET = PackBudget(share=0.25)


def _onednn_packable(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``weight`` may be packed for rows like ``x``: the per-call checks and the
    weight's own, which hold as long as it stays packed."""
    return (
        _takes_rows(weight, x)
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.numel() > 0
    )


def _takes_rows(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """The part of ``_onednn_packable`` that a packed weight still needs checked call by call."""
    return (
        _ONEDNN
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.dim() == 2
        and x.is_contiguous()
        and not (torch.is_grad_enabled() and weight.requires_grad)
    )


_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def int4_packable(out_features: int, in_features: int) -> bool:
    """Whether torch's int4 packer takes this shape: whole groups of 32 in, rows by 16 out."""
    return in_features % INT4_GROUP == 0 and out_features % 16 == 0


def int4_codes(
    w: torch.Tensor, stored: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] float weight -> (codes 0..15 [out, in] uint8, scale and min [out, in/32]).

    Each group of 32 inputs spans its own [min, max]: ``w = code * scale + min``. The scale and
    min are values of ``stored`` (as float32), the codes taken against them: a weight that came
    from Q4_1 blocks (float16 scales and mins) gets its own back with ``stored`` float16.
    """
    out_f, in_f = w.shape
    groups = w.float().reshape(out_f, in_f // INT4_GROUP, INT4_GROUP)
    lo, hi = groups.amin(-1), groups.amax(-1)
    lo = lo.to(stored).float()
    scale = ((hi - lo) / 15).to(stored).float().clamp(min=torch.finfo(stored).tiny)
    q = ((groups - lo[..., None]) / scale[..., None]).round().clamp(0, 15)
    return q.reshape(out_f, in_f).to(torch.uint8), scale, lo


def int8_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float weight -> (int8 [out, in], per-row scales [out]), symmetric."""
    scale = (w.float().abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    return (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def int4_kernel_tensors(
    codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes -> (packed uint8 [out, in/2], scales_and_zeros [groups, out, 2]) for the kernel."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    # The kernel computes (q - 8) * scale + zero, so zero = min + 8 * scale.
    scales_and_zeros = torch.stack([scale, lo + 8 * scale], dim=-1).transpose(0, 1)
    return packed, scales_and_zeros.contiguous().to(dtype)


def pack_int4(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return int4_kernel_tensors(*int4_codes(w), dtype)


def pack_int4_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float weight -> (uint8 [out, in/2], float32 scales_and_mins [out, in/32, 2]).

    Byte j of a group holds column j in its low nibble and column j + 16 in its high one, so a
    kernel unpacks a group of 32 with one mask and one shift (``kernels.decode.cpp``).
    """
    codes, scale, lo = int4_codes(w)
    groups = codes.view(w.shape[0], -1, 2, INT4_GROUP // 2)
    packed = groups[:, :, 0] | (groups[:, :, 1] << 4)
    return packed.reshape(w.shape[0], -1).contiguous(), torch.stack([scale, lo], -1).contiguous()


def pack_int4_vnni(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float weight -> (uint8 [tiles, in/32, 4, 64], float16 [tiles, in/32, 2, 16]):
    the layout of the int4 x int8 kernel (``kernels/decode.cpp``, ``int4_vnni_linear``).

    Outputs go in tiles of 16 (the last one padded with zero codes and scales). For each tile and
    group of 32 inputs, vector p (of 4) holds at byte ``4 * o + i`` output o's code of input
    ``8p + i`` in its low nibble and of input ``8p + 4 + i`` in its high one: each nibble half
    of a 64-byte load is one VNNI operand, 4 inputs for each of 16 outputs. Then the tile's
    scales and mins of the group, 16 of each, float16 as Q4_1's (``int4_codes``): a batched
    decode reads every weight each step, and float32 ones were a third of the bytes.
    """
    return pack_int4_vnni_groups(*int4_codes(w, torch.float16))


def pack_int4_vnni_groups(
    codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_int4_vnni`` from affine groups already found (codes 0..15 [out, in], scale and
    min [out, in/32]; a GGUF's 4-bit blocks, ``loading/dequant.int4_groups``): scales and mins
    rounded to float16 (exact for Q4_0/Q4_1's; a Q4_K sub-block's ``d * sc`` loses under
    2^-11 of itself)."""
    out_f, in_f = codes.shape
    tiles, groups = -(-out_f // VNNI_TILE), in_f // INT4_GROUP
    pad = tiles * VNNI_TILE - out_f
    codes = F.pad(codes, (0, 0, 0, pad))
    scale, lo = F.pad(scale, (0, 0, 0, pad)), F.pad(lo, (0, 0, 0, pad))
    # [tile, o, group, p, half, i] -> [tile, group, p, half, o, i]
    c = codes.view(tiles, VNNI_TILE, groups, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)
    packed = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).reshape(tiles, groups, 4, 64)
    sm = torch.stack([scale, lo], -1).view(tiles, VNNI_TILE, groups, 2).permute(0, 2, 3, 1)
    return packed.contiguous(), sm.half().contiguous()


def pack_int8_vnni(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float weight -> (uint8 [tiles, in/32, 8, 64], float16 [tiles, in/32, 1, 16]):
    the layout of the int8 x int8 kernel (``kernels/decode.cpp``, ``int8_vnni_linear``).

    Symmetric codes per group of 32 inputs with a float16 scale, as GGML's Q8_0 (scale = absmax
    / 127, rounded to float16, codes taken against the rounded scale; weights that came from Q8_0
    blocks get their own codes and scales back), stored plus 128 so that they are VNNI's unsigned
    operand. Outputs go in tiles of 16 (the last one padded with zero scales); for each tile and
    group, vector p (of 8) holds at byte ``4 * o + i`` output o's code of input ``4p + i``. Then
    the tile's 16 scales of the group.
    """
    out_f, in_f = w.shape
    tiles, groups = -(-out_f // VNNI_TILE), in_f // INT4_GROUP
    g = F.pad(w.float(), (0, 0, 0, tiles * VNNI_TILE - out_f)).view(-1, groups, INT4_GROUP)
    scale = (g.abs().amax(-1) / 127).half().float()
    inv = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))
    codes = ((g * inv[..., None]).round().clamp(-127, 127) + 128).to(torch.uint8)
    # [tile, o, group, p, i] -> [tile, group, p, o, i]
    c = codes.view(tiles, VNNI_TILE, groups, 8, 4).permute(0, 2, 3, 1, 4)
    scales = scale.half().view(tiles, VNNI_TILE, groups, 1).permute(0, 2, 3, 1)
    return c.reshape(tiles, groups, 8, 64).contiguous(), scales.contiguous()


def pack_int8(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = int8_codes(w)
    return q, scale.to(dtype)


def dequantize_packed(layer: Linear) -> torch.Tensor:
    """The weight the packed kernel really multiplies by (for tests and diagnostics)."""
    if layer.packed_kind in VNNI_KINDS:  # its rows are quantized: unpack the codes
        assert layer._packed is not None and layer._scales is not None
        codes, scale, lo = unpack_vnni(layer._packed, layer._scales, layer.out_features)
        return (codes * scale[..., None] + lo[..., None]).view(layer.out_features, -1)
    eye = torch.eye(layer.in_features, dtype=layer.weight.dtype)
    saved = layer.small_batch
    layer.small_batch = layer.in_features
    try:
        return layer(eye).T.float()
    finally:
        layer.small_batch = saved
