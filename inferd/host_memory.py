"""What memory the host can give (read by the KV pool's sizing and by caches of packed weights),
and memory backed by huge pages for what a decode step reads all of."""

from __future__ import annotations

import ctypes
import math
import sys
from collections.abc import Sequence

import torch

GIB = 1 << 30
HUGE_PAGE = 2 << 20  # x86-64 and most arm64 kernels' transparent huge page
_MADV_HUGEPAGE = 14  # Linux's value on every architecture


def available_bytes() -> int:
    """Memory the OS can give without swapping (MemAvailable), or a modest 4 GiB guess where
    /proc/meminfo cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * GIB


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` uninitialized uint8, 2 MiB-aligned, that Linux is asked to back with huge
    pages (``madvise(MADV_HUGEPAGE)``, before anything touches them).

    A decode step reads every packed weight and the KV blocks of every running sequence: with
    4 KiB pages that is a TLB miss every 4 KiB, and the hardware prefetcher stops at every page
    edge. SmolLM2 on 2 cores: the paged attention of 16 rows x 256 keys over a pool of
    scattered blocks 1.12x faster on huge pages, a one-row step's int4 matmuls 1.09-1.19x
    (benchmarks/step_profile.md). Most systems leave huge pages to ``madvise`` (the kernel's
    default); where they are off, or on another OS, this is plain memory.
    """
    rounded = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    buf = torch.empty(rounded + HUGE_PAGE, dtype=torch.uint8)
    start = (-buf.data_ptr()) % HUGE_PAGE
    if sys.platform == "linux" and rounded:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(buf.data_ptr() + start, rounded, _MADV_HUGEPAGE)  # advice: failure is fine
    return buf[start : start + nbytes]


def huge_page_zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on huge pages (``huge_page_bytes``)."""
    nbytes = math.prod(shape) * dtype.itemsize
    return huge_page_bytes(nbytes).view(dtype).view(*shape).zero_()


def on_huge_pages(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` side by side in one huge-page buffer (each 64-byte aligned): many
    small weights share the pages rather than each rounding up to 2 MiB."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // 64) * 64
    buf = huge_page_bytes(total)
    out = []
    for t, at in zip(tensors, offsets, strict=True):
        size = t.numel() * t.element_size()
        copy = buf[at : at + size].view(t.dtype).view(t.shape)
        out.append(copy.copy_(t))
    return out
