"""Fused CPU kernels for the decode step (``decode.cpp``), compiled on first use.

A SmolLM2 decode step spent more time dispatching ~45 small PyTorch ops per layer than in its
weight matmuls. Five kernels replace the chains that cost most: RMSNorm, RoPE of q and k
together with the paged K/V write, one-query attention over the paged cache, SiLU(gate) * up,
and a one-row int8 GEMV for the output head. Each is checked against the plain PyTorch path it
replaces (tests/kernels/).

The build runs once per machine and source through torch's extension loader (cached under
``~/.cache/torch_extensions/inferd``; it needs a C++ compiler and ninja). Where it cannot build,
or with ``INFERD_FUSED_KERNELS=0``, every caller keeps the plain PyTorch ops and ``status()``
says why.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sys
import sysconfig
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode.cpp")

_lock = threading.Lock()
_module: Any = None
_tried = False
_reason = "not loaded yet"


def fused() -> Any:
    """The compiled kernels module, or None where they are off or could not be built."""
    if _tried:
        return _module
    with _lock:
        if not _tried:
            _load()
    return _module


def status() -> str:
    """One line for startup and diagnostics: whether the fused kernels are in use."""
    fused()
    return "fused CPU kernels" if _module is not None else f"plain PyTorch ops ({_reason})"


@contextmanager
def unfused() -> Iterator[None]:
    """Run the plain PyTorch ops inside this block (the reference the kernels are tested on)."""
    global _module, _tried
    fused()
    saved = _module
    _module = None
    try:
        yield
    finally:
        _module = saved
        _tried = True


def _load() -> None:
    global _module, _tried, _reason
    _tried = True
    if os.environ.get("INFERD_FUSED_KERNELS", "1") == "0":
        _reason = "INFERD_FUSED_KERNELS=0"
        return
    _ensure_ninja_on_path()
    try:
        from torch.utils.cpp_extension import load

        name, source = _staged_source()
        log.info("loading fused CPU kernels (the first time on a machine builds them: ~30 s)")
        _module = load(
            name=name,
            sources=[str(source)],
            build_directory=str(source.parent),
            # -ffast-math on the compile only (linking it would set flush-to-zero process-wide):
            # it lets the exp and reduction loops vectorize.
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
        _reason = ""
    except Exception as exc:  # no compiler, no ninja, a broken toolchain: run unfused
        lines = str(exc).strip().splitlines() or [""]
        first_error = next((line for line in lines if "error" in line), lines[-1])
        _reason = f"build failed: {type(exc).__name__}: {first_error.strip()}"
        log.warning("fused decode kernels unavailable, using plain PyTorch ops: %s", _reason)


def _staged_source() -> tuple[str, Path]:
    """The extension's name and a copy of its source in the build directory.

    The name carries the CPU's features (the build is ``-march=native``, and a home directory
    may be shared by different machines) and the source's digest; the copy gives every checkout
    or install of the same source one path, so none of them rebuilds what another built.
    """
    text = SOURCE.read_bytes()
    name = f"inferd_decode_{_cpu_tag()}_{hashlib.sha256(text).hexdigest()[:8]}"
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache/torch_extensions")
    build = root / "inferd" / name
    build.mkdir(parents=True, exist_ok=True)
    staged = build / SOURCE.name
    if not staged.exists() or staged.read_bytes() != text:
        tmp = build / f".{SOURCE.name}.{os.getpid()}"
        tmp.write_bytes(text)
        os.replace(tmp, staged)  # atomic: a concurrent start sees the old file or the new one
    return name, staged


def _cpu_tag() -> str:
    """torch's capability name plus a short digest of the CPU's feature flags."""
    flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    digest = hashlib.sha256(flags.encode()).hexdigest()[:8]
    return f"{torch.backends.cpu.get_cpu_capability().lower()}_{digest}"


def _ensure_ninja_on_path() -> None:
    """torch's loader runs ``ninja`` from PATH; the ninja wheel puts it beside this Python."""
    if shutil.which("ninja") is None:
        scripts = sysconfig.get_path("scripts")
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
        if shutil.which("ninja") is None:
            log.debug("no ninja for %s", sys.executable)
