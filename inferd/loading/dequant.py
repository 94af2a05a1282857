"""Dequantize raw GGML tensor data into float32 torch tensors.

GGUF files store most weights in GGML block formats: a tensor row is cut into blocks of
``block_size`` values, and every block is packed into ``type_size`` bytes holding a scale
(sometimes a minimum, sometimes per-sub-block scales) followed by low-bit integers. This module
unpacks those blocks with vectorized torch ops.

The block layouts mirror ggml's ``ggml-common.h``; gguf-py's ``gguf/quants.py`` holds a numpy
reference implementation, which the tests use as the oracle. The arithmetic below performs the
same float32 operations in the same order as that reference, so results match it bit for bit.

All multi-byte fields are little-endian, as in every GGUF file produced on common hardware.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType

__all__ = [
    "FLOAT_TYPES",
    "INT4_GROUP_TYPES",
    "SUPPORTED_TYPES",
    "UnsupportedTensorType",
    "dequantize",
    "int4_groups",
]

Q = GGMLQuantizationType

# Upper bound on the number of output values dequantized at once. Working chunk by chunk keeps
# the temporaries of the bit unpacking small (a few times this many bytes) however large the
# tensor, and lets read-only (memory-mapped) sources be copied piecewise instead of whole.
_CHUNK_ELEMENTS = 1 << 21


class UnsupportedTensorType(ValueError):
    """Raised for a GGML tensor type this module cannot dequantize."""

    def __init__(self, qtype: GGMLQuantizationType | int) -> None:
        name = qtype.name if isinstance(qtype, GGMLQuantizationType) else str(qtype)
        supported = ", ".join(t.name for t in sorted(SUPPORTED_TYPES))
        super().__init__(f"GGUF tensor type {name} is not supported (supported: {supported})")
        self.qtype = qtype


# --------------------------------------------------------------------------------------------
# Small helpers shared by the block decoders. Every decoder takes a uint8 tensor of shape
# (n_blocks, type_size) and returns float32 of shape (n_blocks, block_size).
# --------------------------------------------------------------------------------------------


def _f16(field: torch.Tensor) -> torch.Tensor:
    """(n, 2) uint8 little-endian half floats -> (n, 1) float32.

    ``contiguous()`` first: a column slice of the block matrix cannot be reinterpreted in
    place, because its rows are ``type_size`` bytes apart.
    """
    return field.contiguous().view(torch.float16).to(torch.float32)


def _split_bits(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """Unpack bit fields: (..., m) uint8 -> (..., count, m) uint8.

    Output slot ``k`` holds bits ``[k*width, (k+1)*width)`` of every byte, i.e. field ``k``
    of all ``m`` bytes lies contiguously. That is how ggml packs its low-bit values: the
    ``k``-th group of ``m`` consecutive values goes to the ``k``-th bit field of ``m`` bytes.
    """
    shifts = torch.arange(0, width * count, width, dtype=torch.uint8).view(count, 1)
    return (packed.unsqueeze(-2) >> shifts) & ((1 << width) - 1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, 16) bytes -> (n, 32) 4-bit values: low nibbles are values 0..15, high ones 16..31."""
    return _split_bits(qs, 4, 2).reshape(qs.shape[0], -1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """(n, 4) bytes of a little-endian uint32 -> (n, 32) single bits, bit ``i`` at column ``i``.

    Bit ``i`` of the word is bit ``i % 8`` of byte ``i // 8``; ``_split_bits`` yields
    (byte, bit) as (bit, byte), so swap the two axes before flattening.
    """
    return _split_bits(qh, 1, 8).transpose(-1, -2).reshape(qh.shape[0], 32)


# --------------------------------------------------------------------------------------------
# Plain float formats: "blocks" of one value.
# --------------------------------------------------------------------------------------------


def _dequant_f16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).to(torch.float32)


def _dequant_bf16(blocks: torch.Tensor) -> torch.Tensor:
    # bfloat16 is the top half of a float32, so widening is exact.
    return blocks.contiguous().view(torch.bfloat16).to(torch.float32)


def _dequant_f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32)


# --------------------------------------------------------------------------------------------
# 32-value "legacy" quants.
# --------------------------------------------------------------------------------------------


def _dequant_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0, 18 bytes: x = d * (q - 8).

    byte  0   2                  18
          [ d ][ qs: 16 bytes    ]
          qs[j] = q[j] | q[j + 16] << 4
    """
    d = _f16(blocks[:, 0:2])
    q = _nibbles(blocks[:, 2:18]).to(torch.float32) - 8
    return d * q


def _dequant_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1, 20 bytes: x = d * q + m.

    byte  0   2   4                  20
          [ d ][ m ][ qs: 16 bytes    ]     qs packed as in Q4_0
    """
    d = _f16(blocks[:, 0:2])
    m = _f16(blocks[:, 2:4])
    q = _nibbles(blocks[:, 4:20]).to(torch.float32)
    return d * q + m


def _five_bit(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Join 32 high bits (one uint32) with 32 nibbles into 5-bit values 0..31."""
    return _nibbles(qs) | (_bits32(qh) << 4)


def _dequant_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_0, 22 bytes: x = d * (q - 16), q = nibble | high_bit << 4.

    byte  0   2        6                  22
          [ d ][ qh u32 ][ qs: 16 bytes    ]
          bit i of qh is bit 4 of value i; qs packed as in Q4_0
    """
    d = _f16(blocks[:, 0:2])
    q = _five_bit(blocks[:, 2:6], blocks[:, 6:22]).to(torch.float32) - 16
    return d * q


def _dequant_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_1, 24 bytes: x = d * q + m.

    byte  0   2   4        8                  24
          [ d ][ m ][ qh u32 ][ qs: 16 bytes    ]     bits as in Q5_0
    """
    d = _f16(blocks[:, 0:2])
    m = _f16(blocks[:, 2:4])
    q = _five_bit(blocks[:, 4:8], blocks[:, 8:24]).to(torch.float32)
    return d * q + m


def _dequant_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q8_0, 34 bytes: x = d * q with q a signed byte.

    byte  0   2                        34
          [ d ][ qs: 32 x int8          ]
    """
    d = _f16(blocks[:, 0:2])
    return blocks[:, 2:34].view(torch.int8).to(torch.float32) * d


# --------------------------------------------------------------------------------------------
# 256-value "K" quants: a super-block of QK_K values split into 16 or 8 sub-blocks, each with
# its own small integer scale (and min), themselves scaled by the f16 super-block d (and dmin).
# --------------------------------------------------------------------------------------------


def _dequant_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q2_K, 84 bytes, 16 sub-blocks of 16: x = d * sc * q - dmin * mn.

    byte  0             16              80   82     84
          [ scales x 16 ][ qs: 64 bytes  ][ d ][ dmin ]
          scales[i] = sc | mn << 4   (4 bits each, sub-block i)
          qs = 2 halves x 32 bytes; value 32*k + j of a half is bits 2k..2k+1 of its byte j
    """
    n = blocks.shape[0]
    scales = blocks[:, 0:16]
    d = _f16(blocks[:, 80:82])
    dmin = _f16(blocks[:, 82:84])
    dl = (d * (scales & 0xF).to(torch.float32)).view(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).view(n, 16, 1)
    q = _split_bits(blocks[:, 16:80].reshape(n, 2, 32), 2, 4).reshape(n, 16, 16)
    return (dl * q.to(torch.float32) - ml).reshape(n, QK_K)


def _q3_k_scales(packed: torch.Tensor) -> torch.Tensor:
    """Q3_K's 12 bytes -> 16 signed 6-bit scales (stored with +32 bias).

    Scale s (letters A..P) takes its low 4 bits from bytes 0..7, its high 2 bits from 8..11:
         0: IIIIAAAA    4: MMMMEEEE    8: MMIIEEAA
         1: JJJJBBBB    5: NNNNFFFF    9: NNJJFFBB
         2: KKKKCCCC    6: OOOOGGGG   10: OOKKGGCC
         3: LLLLDDDD    7: PPPPHHHH   11: PPLLHHDD
    """
    n = packed.shape[0]
    low = _split_bits(packed[:, 0:8], 4, 2).reshape(n, 16)
    high = _split_bits(packed[:, 8:12], 2, 4).reshape(n, 16)
    return (low | (high << 4)).to(torch.float32) - 32


def _dequant_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q3_K, 110 bytes, 16 sub-blocks of 16: x = d * sc * q, q in -4..3.

    byte  0              32              96               108  110
          [ hmask: 32 B  ][ qs: 64 bytes  ][ scales: 12 B  ][ d ]
          q = (2 low bits from qs, laid out as in Q2_K) - (4 if the hmask bit is 0 else 0)
          hmask: value 32*k + j has its bit at bit k of byte j
    """
    n = blocks.shape[0]
    d = _f16(blocks[:, 108:110])
    dl = (d * _q3_k_scales(blocks[:, 96:108])).view(n, 16, 1)
    low = _split_bits(blocks[:, 32:96].reshape(n, 2, 32), 2, 4).reshape(n, 16, 16)
    high = _split_bits(blocks[:, 0:32], 1, 8).reshape(n, 16, 16)
    # The "high bit" is inverted: a set bit means no offset, a clear bit means -4.
    q = low.to(torch.float32) - 4 * (1 - high.to(torch.float32))
    return (dl * q).reshape(n, QK_K)


def _k_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins, as float32 (n, 8).

    Sub-blocks 0..3 (A..D scales, a..d mins) are the low 6 bits of bytes 0..7; sub-blocks
    4..7 (E..H, e..h) take 4 bits from bytes 8..11 and 2 bits from the tops of bytes 0..7:
         0: EEAAAAAA    4: eeaaaaaa    8: eeeeEEEE
         1: FFBBBBBB    5: ffbbbbbb    9: ffffFFFF
         2: GGCCCCCC    6: ggcccccc   10: ggggGGGG
         3: HHDDDDDD    7: hhdddddd   11: hhhhHHHH
    """
    sc_lo, mn_lo, mixed = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = torch.cat([sc_lo & 0x3F, (mixed & 0x0F) | ((sc_lo >> 2) & 0x30)], dim=-1)
    mn = torch.cat([mn_lo & 0x3F, (mixed >> 4) | ((mn_lo >> 2) & 0x30)], dim=-1)
    return sc.to(torch.float32), mn.to(torch.float32)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, 128) bytes -> (n, 8, 32) nibbles: 4 chunks of 32 bytes, low nibbles then high."""
    n = qs.shape[0]
    return _split_bits(qs.reshape(n, 4, 32), 4, 2).reshape(n, 8, 32)


def _dequant_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K, 144 bytes, 8 sub-blocks of 32: x = d * sc * q - dmin * mn.

    byte  0   2      4               16                 144
          [ d ][ dmin ][ scales: 12 B ][ qs: 128 bytes   ]
          qs: 4 chunks of 32 bytes; chunk c holds sub-block 2c (low) and 2c+1 (high nibbles)
    """
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2])
    dmin = _f16(blocks[:, 2:4])
    sc, mn = _k_scale_min(blocks[:, 4:16])
    dl = (d * sc).view(n, 8, 1)
    ml = (dmin * mn).view(n, 8, 1)
    q = _k_nibbles(blocks[:, 16:144]).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _dequant_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_K, 176 bytes, 8 sub-blocks of 32: as Q4_K, plus a fifth bit per value.

    byte  0   2      4               16             48                 176
          [ d ][ dmin ][ scales: 12 B ][ qh: 32 B    ][ qs: 128 bytes   ]
          qh: value 32*s + j (sub-block s) has its high bit at bit s of byte j
    """
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2])
    dmin = _f16(blocks[:, 2:4])
    sc, mn = _k_scale_min(blocks[:, 4:16])
    dl = (d * sc).view(n, 8, 1)
    ml = (dmin * mn).view(n, 8, 1)
    high = _split_bits(blocks[:, 16:48], 1, 8)  # (n, 8, 32), already in sub-block order
    q = (_k_nibbles(blocks[:, 48:176]) | (high << 4)).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _dequant_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K, 210 bytes, 16 sub-blocks of 16: x = d * sc * (q - 32), sc a signed byte.

    byte  0                128           192                 208  210
          [ ql: 128 bytes  ][ qh: 64 B   ][ scales: 16 x int8 ][ d ]
          two halves of 128 values; in half h, value 32*k + j (k = 0..3) is
            low 4 bits:  nibble k // 2 of ql[64h + 32*(k % 2) + j]
            high 2 bits: bits 2k..2k+1 of qh[32h + j]
    """
    n = blocks.shape[0]
    d = _f16(blocks[:, 208:210])
    dl = (d * blocks[:, 192:208].view(torch.int8).to(torch.float32)).view(n, 16, 1)
    low = _split_bits(blocks[:, 0:128].reshape(n, 2, 64), 4, 2).reshape(n, 8, 32)
    high = _split_bits(blocks[:, 128:192].reshape(n, 2, 32), 2, 4).reshape(n, 8, 32)
    q = (low | (high << 4)).to(torch.float32) - 32
    return (dl * q.view(n, 16, 16)).reshape(n, QK_K)


_DECODERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.F32: _dequant_f32,
    Q.F16: _dequant_f16,
    Q.BF16: _dequant_bf16,
    Q.Q4_0: _dequant_q4_0,
    Q.Q4_1: _dequant_q4_1,
    Q.Q5_0: _dequant_q5_0,
    Q.Q5_1: _dequant_q5_1,
    Q.Q8_0: _dequant_q8_0,
    Q.Q2_K: _dequant_q2_k,
    Q.Q3_K: _dequant_q3_k,
    Q.Q4_K: _dequant_q4_k,
    Q.Q5_K: _dequant_q5_k,
    Q.Q6_K: _dequant_q6_k,
}

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_DECODERS)


# --------------------------------------------------------------------------------------------
# 4-bit formats as affine groups of 32 (``code * scale + lo``, codes 0..15): what the int4
# kernels take (layers/linear.py), read straight from the blocks. Going through float32 values
# instead would make the packer find each group's range again, which differs from the block's
# wherever a group lacks code 0 or 15 (a Q4_K sub-block's min is not always among its values).
# --------------------------------------------------------------------------------------------

Int4Groups = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # codes, scale, lo


def _groups_q4_0(blocks: torch.Tensor) -> Int4Groups:
    d = _f16(blocks[:, 0:2])
    return _nibbles(blocks[:, 2:18]), d, -8 * d


def _groups_q4_1(blocks: torch.Tensor) -> Int4Groups:
    return _nibbles(blocks[:, 4:20]), _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])


def _groups_q4_k(blocks: torch.Tensor) -> Int4Groups:
    n = blocks.shape[0]
    sc, mn = _k_scale_min(blocks[:, 4:16])
    codes = _k_nibbles(blocks[:, 16:144]).reshape(n, QK_K)
    return codes, _f16(blocks[:, 0:2]) * sc, -(_f16(blocks[:, 2:4]) * mn)


_INT4_DECODERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], Int4Groups]] = {
    Q.Q4_0: _groups_q4_0,
    Q.Q4_1: _groups_q4_1,
    Q.Q4_K: _groups_q4_k,
}

INT4_GROUP_TYPES: frozenset[GGMLQuantizationType] = frozenset(_INT4_DECODERS)
# Types whose tensors hold plain floats, not quantized blocks.
FLOAT_TYPES: frozenset[GGMLQuantizationType] = frozenset({Q.F32, Q.F16, Q.BF16})


def int4_groups(
    raw: np.ndarray | torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, int]
) -> Int4Groups:
    """A 4-bit tensor's raw blocks -> (codes uint8 [rows, cols], scale and lo float32
    [rows, cols / 32]): value ``code * scale + lo`` per group of 32 columns, as ``dequantize``
    computes it (Q4_K: the sub-block's ``d * sc`` and ``-dmin * m``)."""
    decoder = _INT4_DECODERS.get(qtype)
    if decoder is None:
        raise UnsupportedTensorType(qtype)
    rows, cols = shape
    data = _flat_bytes(raw)
    _check_size(data.shape[0], qtype, shape)
    blocks = data.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    codes, scale, lo = decoder(blocks if isinstance(blocks, torch.Tensor) else _to_torch(blocks))
    return codes.reshape(rows, cols), scale.reshape(rows, -1), lo.reshape(rows, -1)


# --------------------------------------------------------------------------------------------
# Entry point.
# --------------------------------------------------------------------------------------------


def _native(array: np.ndarray) -> np.ndarray:
    """C-contiguous and in host byte order, so its bytes can be reinterpreted as-is."""
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    return np.ascontiguousarray(array)


def _to_torch(array: np.ndarray) -> torch.Tensor:
    """Share memory with ``array`` when it is writable, copy it otherwise.

    GGUFReader memory-maps files read-only. torch cannot mark a tensor read-only, so wrapping
    such memory would warn, and an in-place op on the result would crash the process.
    """
    if not array.flags.writeable:
        array = array.copy()
    return torch.from_numpy(array)


def _flat_bytes(raw: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
    """View ``raw``'s bytes as a flat uint8 array, without copying when possible."""
    if isinstance(raw, torch.Tensor):
        return raw.contiguous().view(-1).view(torch.uint8)
    return _native(raw).reshape(-1).view(np.uint8)


def _check_size(nbytes: int, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> None:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if shape and shape[-1] % block_size:
        raise ValueError(
            f"{qtype.name} tensor rows must be a multiple of {block_size} values, got shape {shape}"
        )
    expected = int(np.prod(shape, dtype=np.int64)) // block_size * type_size
    if nbytes != expected:
        raise ValueError(
            f"{qtype.name} tensor of shape {shape} needs {expected} bytes, got {nbytes}"
        )


def dequantize(
    raw: np.ndarray | torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]
) -> torch.Tensor:
    """Decode a tensor's raw GGML data into a contiguous float32 tensor of ``shape``.

    ``raw`` holds the tensor's bytes in any dtype or shape, e.g. ``ReaderTensor.data`` from
    ``gguf.GGUFReader`` (uint8 rows for block types, float16/float32 for F16/F32).
    ``shape`` is the torch (row-major) shape: the reverse of the GGUF dimension list.

    A writable float32 source is returned without copying (the result shares its memory);
    everything else produces a new tensor.
    """
    decoder = _DECODERS.get(qtype)
    if decoder is None:
        raise UnsupportedTensorType(qtype)
    shape = tuple(int(dim) for dim in shape)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    data = _flat_bytes(raw)
    _check_size(data.shape[0], qtype, shape)
    blocks = data.reshape(-1, type_size)

    if qtype == Q.F32:
        source = blocks if isinstance(blocks, torch.Tensor) else _to_torch(blocks)
        return source.view(torch.float32).view(shape)

    n_blocks = blocks.shape[0]
    out = torch.empty((n_blocks, block_size), dtype=torch.float32)
    step = max(1, _CHUNK_ELEMENTS // block_size)
    for start in range(0, n_blocks, step):
        chunk = blocks[start : start + step]
        out[start : start + step] = decoder(
            chunk if isinstance(chunk, torch.Tensor) else _to_torch(chunk)
        )
    return out.view(shape)
