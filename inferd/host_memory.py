"""What memory the host can give (read by the KV pool's sizing and by caches of packed weights),
and memory backed by huge pages for what a decode step reads all of."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import sys
import threading
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
    buf = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # untouched slack costs no RAM
    start = (-buf.data_ptr()) % HUGE_PAGE
    # Whole huge pages only: a touched huge page is 2 MiB of RAM however little of it is used,
    # and the tail of each buffer would round up (the KV pool's 60 tensors: ~85 MiB more RSS).
    whole = nbytes // HUGE_PAGE * HUGE_PAGE
    if sys.platform == "linux" and whole:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(buf.data_ptr() + start, whole, _MADV_HUGEPAGE)  # advice: failure is fine
    return buf[start : start + nbytes]


def huge_page_zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on huge pages (``huge_page_bytes``)."""
    nbytes = math.prod(shape) * dtype.itemsize
    return huge_page_bytes(nbytes).view(dtype).view(*shape).zero_()


class HugePageArena:
    """One huge-page buffer that tensors are copied into side by side, each 64-byte aligned:
    many small weights share the pages rather than each rounding up to 2 MiB. A caller that
    drops each original as it places its copy holds little more than one copy at any time (the
    arena's pages are taken as they are written)."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self._buf = huge_page_bytes(sum(_aligned(n) for n in sizes))
        self._at = 0

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` in the arena's next free bytes."""
        size = t.numel() * t.element_size()
        if self._at + size > self._buf.numel():
            raise ValueError(f"no room for {size} bytes: the arena was sized for others")
        copy = self._buf[self._at : self._at + size].view(t.dtype).view(t.shape)
        self._at += _aligned(size)
        return copy.copy_(t)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def release_free_heap() -> None:
    """Hand freed heap pages back to the OS. glibc keeps them otherwise, in the arena of the
    thread that freed them: a decoded image is freed in 16 MiB blocks below its mmap
    threshold, so gigabytes of decoded pixels stay resident after the images are gone."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


_trim_lock = threading.Lock()
_trim_pending = False


def release_free_heap_soon() -> None:
    """``release_free_heap`` on a short-lived thread (it walks every arena: not for the event
    loop), once for any number of calls made before it starts."""
    global _trim_pending
    with _trim_lock:
        if _trim_pending:
            return
        _trim_pending = True
    threading.Thread(target=_trim_now, name="inferd-heap-trim", daemon=True).start()


def _trim_now() -> None:
    global _trim_pending
    with _trim_lock:
        _trim_pending = False
    release_free_heap()
