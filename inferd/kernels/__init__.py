"""Kernel ops for the decode step, chosen once per model: fused C++ or plain PyTorch.

A SmolLM2 decode step spent more time dispatching ~45 small PyTorch ops per layer than in its
weight matmuls. The kernels of ``decode.cpp`` replace the chains that cost most: RMSNorm (with
the residual add before it), RoPE of q and k together with the paged K/V write, one-query
attention over the paged cache, SiLU(gate) * up, and the int8 (and the float32 models' int4)
weight-only matmuls of small batches. ``KernelOps`` (ops.py) is their typed interface;
``PlainOps`` (plain.py) is the PyTorch reference each kernel is checked against (tests/kernels/),
``FusedOps`` (fused.py) the compiled kernels. ``load_ops`` picks one for a model when its engine
is assembled.

The build targets an instruction set (``ISAS``): ``avx512`` (AVX-512 with BF16 and VNNI) or
``avx2`` (AVX2, FMA, F16C), the best the CPU has, or the one ``INFERD_KERNEL_ISA`` names (so an
AVX-512 machine can build and test what an AVX2 one runs). It runs once per ISA and source
through torch's extension loader (cached under ``~/.cache/torch_extensions/inferd``; it needs a
C++ compiler and ninja). Where it cannot build,
with ``INFERD_FUSED_KERNELS=0``, or for a dtype the kernels do not take, a model runs the plain
ops and their description says why.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from inferd.kernels.fused import CompiledKernels, FusedOps
from inferd.kernels.ops import KernelOps
from inferd.kernels.plain import PlainOps

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode.cpp")
FUSED_DTYPES = (torch.float32, torch.bfloat16)
ISA_ENV = "INFERD_KERNEL_ISA"


@dataclass(frozen=True, slots=True)
class Isa:
    """One build target of ``decode.cpp``: the CPU flags it needs and the compiler's."""

    name: str
    needs: frozenset[str]
    cflags: tuple[str, ...]


# Best first. AVX-512 without BF16/VNNI (Skylake-X, Ice Lake) builds the AVX2 target and runs as
# an AVX2 machine: f32 with inferd's packed kernels (loading.model.resolve_dtype), as bf16 is
# emulated there.
ISAS = (
    Isa(
        "avx512",
        frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "fma", "f16c"}),
        (
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512bf16",
            "-mavx512vnni",
            "-mavx2",
            "-mfma",
            "-mf16c",
        ),
    ),
    Isa("avx2", frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c")),
)
# How long a start waits for another process's build of the same source before giving up on it
# (a build takes ~30-60 s; a loaded machine may take a few times that).
BUILD_WAIT_S = 600.0

_lock = threading.Lock()
_compiled: CompiledKernels | None = None
_tried = False
_reason = "not loaded yet"


def load_ops(dtype: torch.dtype) -> KernelOps:
    """The ops a model computing in ``dtype`` runs on: the fused kernels where they build and
    take the dtype, else the plain PyTorch ops, whose description says why."""
    if dtype not in FUSED_DTYPES:
        return PlainOps(f"the fused kernels take float32 and bfloat16, not {dtype}")
    compiled = _load_once()
    if compiled is None:
        return PlainOps(_reason)
    isa = kernel_isa()
    return FusedOps(compiled, isa.name if isa is not None else "baseline")


def build_status() -> str:
    """What a start would run, without building anything (for ``inferd doctor``)."""
    if os.environ.get("INFERD_FUSED_KERNELS", "1") == "0":
        return "plain PyTorch ops (INFERD_FUSED_KERNELS=0)"
    try:
        name, isa = _extension_name(), kernel_isa()
    except ValueError as exc:  # a bad INFERD_KERNEL_ISA: a start would run the plain ops
        return f"plain PyTorch ops (build failed: {exc})"
    target = isa.name if isa is not None else "no SIMD target"
    if any((build_root() / name).glob(f"{name}*.so")):
        return f"fused CPU kernels, {target} build (built for this source; f16 runs plain ops)"
    return f"fused CPU kernels, {target} build at the first start (~30-60 s: C++ compiler, ninja)"


def packs_weights(dtype: torch.dtype) -> bool:
    """Whether a model in ``dtype`` gets int4/int8 weight copies for small batches: bf16 always
    (torch's weight-only kernels take bf16 well), float32 where the kernels are the AVX2 build
    and built (float32 is the auto dtype there, and torch's kernels are ~10x slower than dense
    with float32 activations, so only inferd's run them)."""
    if dtype == torch.bfloat16:
        return True
    isa = kernel_isa()
    return (
        dtype == torch.float32
        and isa is not None
        and isa.name == "avx2"
        and (_load_once() is not None)
    )


INT4_INT8_ENV = "INFERD_INT4_INT8"


def int8_dot(dtype: torch.dtype) -> bool:
    """Whether packed (int4/int8) weights of a model in ``dtype`` run the VNNI kernels
    (decode.cpp's ``vnni_linear``, activations quantized to int8 on the fly): bf16 models on the
    built avx512 target (VNNI: twice the multiplies of the bf16 instruction), unless
    ``INFERD_INT4_INT8=0`` turns it off. On by default, as llama.cpp runs Q4 and Q8_0 weights:
    ~1.3x faster batched decode steps (layers/linear.py) for some accuracy (SmolLM2: mean KL to
    float32 0.0036 against 0.0021 for packed weights with bf16 rows; README,
    benchmarks/accuracy.py)."""
    if dtype != torch.bfloat16 or os.environ.get(INT4_INT8_ENV, "1") == "0":
        return False
    try:
        isa = kernel_isa()
    except ValueError:  # a bad INFERD_KERNEL_ISA: the model runs the plain ops
        return False
    return isa is not None and isa.name == "avx512" and _load_once() is not None


def forced_isa() -> str | None:
    """The ISA ``INFERD_KERNEL_ISA`` forces, if any (lower case)."""
    return os.environ.get(ISA_ENV, "").strip().lower() or None


def kernel_isa() -> Isa | None:
    """The ISA the kernels are built for: ``INFERD_KERNEL_ISA`` where set (it must be one this
    CPU runs), else the best of ``ISAS`` the CPU has; None where it has none of them (the build
    then targets the plain x86-64/arm64 baseline)."""
    forced = forced_isa()
    if forced:
        isa = next((i for i in ISAS if i.name == forced), None)
        if isa is None:
            raise ValueError(f"{ISA_ENV}={forced!r}: choose one of {[i.name for i in ISAS]}")
        if not isa.needs <= cpu_flags():
            lacks = sorted(isa.needs - cpu_flags())
            raise ValueError(f"{ISA_ENV}={forced}: this CPU lacks {lacks}")
        return isa
    return next((i for i in ISAS if i.needs <= cpu_flags()), None)


def _load_once() -> CompiledKernels | None:
    global _tried
    if not _tried:
        with _lock:
            if not _tried:
                _load()
                _tried = True
    return _compiled


def _load() -> None:
    global _compiled, _reason
    if os.environ.get("INFERD_FUSED_KERNELS", "1") == "0":
        _reason = "INFERD_FUSED_KERNELS=0"
        return
    _ensure_ninja_on_path()
    try:
        from torch.utils.cpp_extension import load

        name, source = _staged_source()
        log.info("loading fused CPU kernels (the first time on a machine builds them: ~30 s)")
        with build_lock(source.parent, BUILD_WAIT_S):
            module = load(
                name=name,
                sources=[str(source)],
                build_directory=str(source.parent),
                # -ffast-math on the compile only (linking it would set flush-to-zero
                # process-wide): it lets the exp and reduction loops vectorize.
                extra_cflags=["-O3", *_isa_cflags(), "-fopenmp", "-ffast-math"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        _compiled = cast(CompiledKernels, module)
        _reason = ""
    except Exception as exc:  # no compiler, no ninja, a broken toolchain: run the plain ops
        lines = str(exc).strip().splitlines() or [""]
        first_error = next((line for line in lines if "error" in line), lines[-1])
        _reason = f"build failed: {type(exc).__name__}: {first_error.strip()}"
        log.warning("fused decode kernels unavailable, using plain PyTorch ops: %s", _reason)


@contextlib.contextmanager
def build_lock(build: Path, wait_s: float) -> Iterator[None]:
    """Hold the build directory for one process at a time, and clear a lock left behind.

    torch's loader marks a build in progress with a ``lock`` file it deletes when done; a build
    that was killed leaves the file, and every later start would wait for it forever. Every
    start takes this ``flock`` before the loader runs, and the OS releases an ``flock`` when its
    holder dies: whoever holds it finds any ``lock`` file stale and removes it. Waiting for a
    live holder is bounded by ``wait_s`` (then TimeoutError).
    """
    deadline = time.monotonic() + wait_s
    with open(build / "inferd-build.lock", "a") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"another process has held the kernel build in {build} for over "
                        f"{wait_s:.0f} s"
                    ) from None
                time.sleep(0.2)
        try:
            stale = build / "lock"
            if stale.exists():
                log.warning("removing %s, left by a kernel build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _staged_source() -> tuple[str, Path]:
    """The extension's name and a copy of its source in the build directory.

    The name carries the ISA and the source's digest (a home directory may be shared by
    different machines; each builds and keeps its own ISA's); the copy gives every checkout
    or install of the same source one path, so none of them rebuilds what another built.
    """
    text = SOURCE.read_bytes()
    name = _extension_name()
    build = build_root() / name
    build.mkdir(parents=True, exist_ok=True)
    staged = build / SOURCE.name
    if not staged.exists() or staged.read_bytes() != text:
        tmp = build / f".{SOURCE.name}.{os.getpid()}"
        tmp.write_bytes(text)
        os.replace(tmp, staged)  # atomic: a concurrent start sees the old file or the new one
    return name, staged


def _extension_name() -> str:
    # The torch install is part of the key: its headers and libraries are in the build rules,
    # so two environments sharing one build directory would rebuild it for each other (and
    # make each other's servers wait for the build lock) at every start. The path as torch
    # writes it in those rules, not resolved: a virtualenv reached through a symlink (a git
    # worktree's) writes other rules than the one it points to.
    flags = " ".join(_isa_cflags()).encode()
    torch_dir = str(Path(torch.__file__).parent).encode()
    digest = hashlib.sha256(SOURCE.read_bytes() + flags + torch_dir).hexdigest()[:8]
    isa = kernel_isa()
    return f"inferd_decode_{isa.name if isa else 'baseline'}_{digest}"


def _isa_cflags() -> tuple[str, ...]:
    isa = kernel_isa()
    return isa.cflags if isa is not None else ()


def build_root() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache/torch_extensions"
    return Path(root) / "inferd"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo), empty where they cannot be read."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    return frozenset()


def _ensure_ninja_on_path() -> None:
    """torch's loader runs ``ninja`` from PATH; the ninja wheel puts it beside this Python."""
    if shutil.which("ninja") is None:
        scripts = sysconfig.get_path("scripts")
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
        if shutil.which("ninja") is None:
            log.debug("no ninja for %s", sys.executable)
