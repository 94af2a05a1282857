"""The machine features some tests need, and the skip reasons for their absence.

Each reason starts with ``machine:`` and is worded to match an entry of tests/skip_policy.py's
``ALLOWED`` (tests/test_skip_policy.py checks that), so these are the only skips a run allows.
"""

from __future__ import annotations

import os
import sys

from inferd import kernels

NOT_LINUX_REASON = "machine: not Linux: madvise(MADV_HUGEPAGE) and /proc/self/smaps are Linux's"
NOT_LINUX = NOT_LINUX_REASON if sys.platform != "linux" else None


def vnni_missing() -> str | None:
    """Why the kernels' int8 (VNNI) path cannot run here, None where it can.

    Only the machine (its CPU, or a forced build target) is an allowed reason.
    ``INFERD_INT4_INT8=0`` is said as it is, which the skip policy does not allow (the run
    fails, naming it); a failed build is no reason at all (the test runs, and fails)."""
    avx512 = next(isa for isa in kernels.ISAS if isa.name == "avx512")
    lacks = sorted(avx512.needs - kernels.cpu_flags())
    if lacks:
        return f"machine: this CPU lacks AVX-512 VNNI/BF16 (no {', '.join(lacks)})"
    forced = kernels.forced_isa()
    if forced and forced != avx512.name:
        return f"machine: INFERD_KERNEL_ISA={forced} builds the kernels without VNNI"
    if os.environ.get(kernels.INT4_INT8_ENV, "1") == "0":
        return f"{kernels.INT4_INT8_ENV}=0 turns the VNNI kernels off"
    return None
