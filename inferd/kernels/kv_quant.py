"""The int8 KV cache's layout, and its quantization in plain PyTorch (the reference the fused
kernels match bit for bit on the write, and what the plain ops run).

An int8 cache has the float caches' shape with two more bytes per row::

    [num_blocks, block_size, num_kv_heads, head_dim + SCALE_BYTES]  int8

Each (token, KV head) row is ``head_dim`` signed codes followed by its float16 scale: the value
is ``code * scale``, with ``scale = absmax(row) / 127`` (symmetric; codes in [-127, 127]).

Why one scale per token and head, not per block: tokens are written one at a time (a decode
writes one row per step), and a block's scale fixed by its first token would clip later ones,
while rescaling a block on each write would requantize its earlier rows (lossy each time, and
their bits would depend on how the prompt was chunked). A row's own scale makes every write
final and exact: a row's codes depend on its values alone, so a prompt cached in one chunk or
many, alone or in a batch, holds the same bytes (--deterministic relies on that).

Why inside the row: a block then carries its scales, so everything that moves, shares or drops
blocks (prefix caching, preemption, speculative truncation) needs nothing new. The float16 scale
costs 2 bytes per 64-value head: 66 bytes a row against bfloat16's 128, 1.94x the tokens (a
float32 scale would be 68 bytes, 1.88x).

The arithmetic is written so the C++ kernels can repeat it exactly: the scale is
``float16(absmax * (1 / 127))`` and a code is ``round_half_even(x * (1 / scale))``, each step
in float32 (a multiplication by a reciprocal, which ``-ffast-math`` leaves alone, rather than
a division it might rewrite).
"""

from __future__ import annotations

import torch

SCALE_BYTES = 2  # the float16 scale behind each row's codes
QMAX = 127
INV_QMAX = 1.0 / QMAX  # float32(1/127) in both implementations

# The --kv-cache-dtype names and the storage dtype each means (auto: the model's own).
KV_DTYPES = {
    "bf16": torch.bfloat16,
    "f32": torch.float32,
    "int8": torch.int8,
}


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (token, KV head) row in a cache of ``dtype``."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def head_dim_of(cache: torch.Tensor) -> int:
    """The head size a cache holds (its rows minus the scale in an int8 cache)."""
    return cache.shape[-1] - SCALE_BYTES if is_quantized(cache) else cache.shape[-1]


def bytes_per_value(head_dim: int, dtype: torch.dtype) -> float:
    """Bytes the cache spends per K or V value, scales included (the sizing's unit)."""
    return row_width(head_dim, dtype) * dtype.itemsize / head_dim


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] (float32 or bfloat16) -> int8 rows [..., head_dim + SCALE_BYTES]."""
    x32 = x.float()
    scale = (x32.abs().amax(-1, keepdim=True) * INV_QMAX).to(torch.float16)
    inv = torch.where(scale > 0, 1.0 / scale.float(), torch.zeros_like(scale, dtype=torch.float32))
    codes = torch.round(x32 * inv).clamp_(-QMAX, QMAX).to(torch.int8)
    return torch.cat((codes, scale.view(torch.int8)), dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., head_dim + SCALE_BYTES] -> values [..., head_dim] in ``dtype`` (each
    ``code * scale`` in float32, then rounded to ``dtype``)."""
    codes = rows[..., :-SCALE_BYTES]
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float16)
    return (codes.float() * scale.float()).to(dtype)


def cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype ``--kv-cache-dtype name`` means for a model computing in
    ``model_dtype`` (auto: the model's own, as before int8 caches existed)."""
    if name == "auto":
        return model_dtype
    if name not in KV_DTYPES:
        raise ValueError(
            f"unknown KV cache dtype {name!r}: choose auto or one of {list(KV_DTYPES)}"
        )
    return KV_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The short name (bf16, f32, int8, f16) of a cache dtype, for the startup line and /metrics."""
    names = {v: k for k, v in KV_DTYPES.items()} | {torch.float16: "f16"}
    return names.get(dtype, str(dtype).removeprefix("torch."))
