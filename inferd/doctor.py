"""``inferd doctor [--json]`` and ``GET /v1/system/info``: the facts that decide how inferd runs
here, collected without loading a model.

- software: inferd, Python, torch (version, build, CUDA build, BLAS / oneDNN / OpenMP);
- CPU: model, logical CPUs and the ones this process may use, the instruction-set features that
  matter for the kernels (AVX2, AVX-512, AVX512-BF16, VNNI, AMX) from ``/proc/cpuinfo``, and
  torch's own reading of them (``get_cpu_capability``);
- CUDA devices (inferd computes on the CPU; they are listed for the record);
- threads, RAM (total and available);
- the model store (each manifest's digest, size, and the quantized entries) and the Hugging
  Face cache location;
- what inferd would choose: the dtype for ``--dtype auto``, the matmul kernels (dense, the int4 /
  int8 small-batch copies, ISQ), attention; and what each kernel ISA gets (``isa_table``), with
  the one this machine runs marked.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from inferd import kernels
from inferd.version import __version__

# /proc/cpuinfo flags worth reporting, and what they mean for inferd.
CPU_FLAGS = {
    "avx2": "AVX2",
    "fma": "FMA",
    "avx512f": "AVX-512F",
    "avx512bw": "AVX-512BW",
    "avx512_vnni": "AVX-512 VNNI (int8 dot products)",
    "avx512_bf16": "AVX-512 BF16 (native bf16 arithmetic)",
    "amx_tile": "AMX tiles",
    "amx_bf16": "AMX BF16",
    "amx_int8": "AMX INT8",
}


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    flags: set[str] = set()
    model = platform.processor() or platform.machine()
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("flags", "Features") and not flags:
                flags = set(value.split())
            elif key == "model name" and value.strip():
                model = value.strip()
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    return {
        "model": model,
        "architecture": platform.machine(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable,
        "features": {flag: flag in flags for flag in CPU_FLAGS},
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
    }


def memory_info(meminfo: Path = Path("/proc/meminfo")) -> dict[str, int | None]:
    """MiB of RAM in total and available without swapping (None where unknown)."""
    out: dict[str, int | None] = {"total_mb": None, "available_mb": None}
    try:
        for line in meminfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "MemTotal":
                out["total_mb"] = int(value.split()[0]) // 1024
            elif key == "MemAvailable":
                out["available_mb"] = int(value.split()[0]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def torch_info() -> dict[str, Any]:
    openmp = getattr(torch.backends, "openmp", None)
    return {
        "version": torch.__version__,
        "git_version": getattr(torch.version, "git_version", None),
        "debug": bool(torch.version.debug),
        "cuda_build": torch.version.cuda,
        "mkl": torch.backends.mkl.is_available(),
        "mkldnn": torch.backends.mkldnn.is_available(),
        "openmp": bool(openmp.is_available()) if openmp is not None else None,
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "env": {
            k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ
        },
    }


def cuda_devices() -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        return []
    devices = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        devices.append(
            {
                "index": i,
                "name": props.name,
                "memory_mb": props.total_memory // 2**20,
                "capability": f"{props.major}.{props.minor}",
            }
        )
    return devices


def store_info(home: Path | None = None) -> dict[str, Any]:
    """The store's models (from their manifests: no file is re-hashed) and quantized entries."""
    from inferd.hf_cache import hub_cache
    from inferd.loading.quantize import list_quantized
    from inferd.store import ModelStore

    store = ModelStore(home)
    models = []
    for m in store.list():
        snap = store.snapshot_dir(m.name)
        size = sum((snap / rel).stat().st_size for rel in m.files if (snap / rel).is_file())
        complete = store.entry_path(m.name) is not None
        models.append(
            {
                "name": m.name,
                "package": f"{m.package}=={m.version}",
                "digest": f"sha256:{m.digest}",
                "size_mb": round(size / 2**20, 1),
                "complete": complete,
                "files": {rel: f"sha256:{d}" for rel, d in sorted(m.files.items())},
            }
        )
    quantized = [
        {
            "name": q.name,
            "source": q.source_name,
            "source_digest": f"sha256:{q.source_digest}",
            "method": q.method,
            "group_size": q.group_size,
            "imatrix": f"sha256:{q.imatrix}" if q.imatrix else None,
            "files": {rel: f"sha256:{d}" for rel, d in q.files.items()},
            "path": str(path),
        }
        for path, q in list_quantized(store.home)
    ]
    hub = hub_cache()
    repos = sorted(
        p.name.removeprefix("models--").replace("--", "/", 1)
        for p in (hub.glob("models--*") if hub.is_dir() else [])
    )
    return {
        "home": str(store.home),
        "models": models,
        "quantized": quantized,
        "hf_cache": {"path": str(hub), "models": repos},
    }


# What each build target of the kernels (kernels.ISAS, and none) gets: the auto dtype, the
# matmuls, the small-batch copies and the decode ops. "avx512" is AVX-512 with BF16 and VNNI.
ISA_TABLE: tuple[dict[str, str], ...] = (
    {
        "isa": "avx512",
        "needs": "AVX-512 F/BW/VL + BF16 + VNNI",
        "dtype": "bf16",
        "matmul": "dense bf16 (oneDNN, weights prepacked) for prompts and batches over 8 rows",
        "packed": "int4/int8 weight-only (torch's kernels, bf16 activations) for <= 8 rows",
        "decode_ops": "fused kernels, avx512 build",
    },
    {
        "isa": "avx2",
        "needs": "AVX2 + FMA + F16C",
        "dtype": "f32",
        "matmul": "dense f32 (MKL/oneDNN) for prompts and batches over 8 rows",
        "packed": "int4/int8 weight-only (inferd's AVX2 kernels, f32 activations) for <= 8 rows",
        "decode_ops": "fused kernels, avx2 build",
    },
    {
        "isa": "baseline",
        "needs": "neither",
        "dtype": "f32",
        "matmul": "dense f32",
        "packed": "off",
        "decode_ops": "fused kernels, baseline build (scalar loops)",
    },
)


def isa_table() -> list[dict[str, Any]]:
    """``ISA_TABLE`` with the row this machine runs marked (``"this_machine": True``)."""
    try:
        isa = kernels.kernel_isa()
        current = isa.name if isa is not None else "baseline"
    except ValueError:  # a bad INFERD_KERNEL_ISA: no row is this machine's
        current = ""
    return [{**row, "this_machine": row["isa"] == current} for row in ISA_TABLE]


def choices(cpu: dict[str, Any]) -> dict[str, Any]:
    """What inferd would pick on this host, and why."""
    from inferd.loading.model import resolve_dtype

    dtype = resolve_dtype("auto")
    bf16 = dtype == torch.bfloat16
    capability = cpu["torch_capability"]
    native_bf16 = cpu["features"].get("avx512_bf16") or cpu["features"].get("amx_bf16")
    table = isa_table()
    isa = next((row["isa"] for row in table if row["this_machine"]), "?")
    forced = kernels.forced_isa()
    packed_f32 = isa == "avx2" and kernels.build_status().startswith("fused")
    return {
        "dtype": "bf16" if bf16 else "f32",
        "dtype_reason": (
            f"torch CPU capability {capability}, kernels {isa}: native bf16"
            if bf16
            else f"torch CPU capability {capability}, kernels {isa}"
            + (" (forced)" if forced else "")
            + ": no native bf16, so float32"
        ),
        "native_bf16": bool(native_bf16),
        "kernel_isa": isa + (" (forced by INFERD_KERNEL_ISA)" if forced else ""),
        "isa_table": table,
        "matmul": "dense bf16 (oneDNN)" if bf16 else "dense f32 (MKL/oneDNN)",
        "packed_kernels": (
            "int4/int8 weight copies for batches of at most 8 rows (decode)"
            if bf16
            else "int4/int8 weight copies for batches of at most 8 rows (decode; inferd's AVX2 "
            "kernels, f32 activations)"
            if packed_f32
            else "off (no AVX2 kernels here for packed float32 weights)"
        ),
        "fused_kernels": kernels.build_status(),
        "isq": "available: --isq q8 (int8 per row) | q4 (int4, groups of 32); kernels run in bf16",
        "attention": "paged KV cache, torch scaled_dot_product_attention (eager with soft-capping)",
    }


def collect(home: Path | None = None) -> dict[str, Any]:
    cpu = cpu_info()
    return {
        "inferd": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch_info(),
        "cpu": cpu,
        "cuda": {"available": torch.cuda.is_available(), "devices": cuda_devices()},
        "memory": memory_info(),
        "store": store_info(home),
        "choices": choices(cpu),
    }


def format_text(info: dict[str, Any]) -> str:
    t, cpu, mem, store, ch = (
        info["torch"],
        info["cpu"],
        info["memory"],
        info["store"],
        info["choices"],
    )
    features = [label for flag, label in CPU_FLAGS.items() if cpu["features"].get(flag)]
    missing = [label for flag, label in CPU_FLAGS.items() if not cpu["features"].get(flag)]
    lines = [
        f"inferd     {info['inferd']}  (Python {info['python']}, {info['platform']})",
        f"torch      {t['version']}  build {t['git_version'] or '?'}"
        f"{'  DEBUG' if t['debug'] else ''}  CUDA build {t['cuda_build'] or 'none'}",
        f"           MKL {_yes(t['mkl'])}  oneDNN {_yes(t['mkldnn'])}  OpenMP {_yes(t['openmp'])}",
        f"cpu        {cpu['model']} ({cpu['architecture']}), {cpu['logical_cpus']} logical CPUs, "
        f"{cpu['usable_cpus']} usable; torch capability {cpu['torch_capability']}",
        f"           has: {', '.join(features) or 'none of the listed features'}",
        f"           lacks: {', '.join(missing) or 'nothing listed'}",
        f"threads    {t['threads']} intra-op, {t['interop_threads']} inter-op"
        + "".join(f"  {k}={v}" for k, v in t["env"].items()),
        f"memory     {_mb(mem['total_mb'])} total, {_mb(mem['available_mb'])} available",
    ]
    devices = info["cuda"]["devices"]
    lines.append(
        "cuda       "
        + (
            "; ".join(
                f"#{d['index']} {d['name']} {d['memory_mb']} MiB sm_{d['capability']}"
                for d in devices
            )
            if devices
            else "no devices (inferd computes on the CPU)"
        )
    )
    lines.append(f"store      {store['home']}")
    for m in store["models"]:
        state = "" if m["complete"] else "  INCOMPLETE"
        lines.append(
            f"           {m['name']:<10} {m['package']:<28} {m['size_mb']:>8.1f} MiB  "
            f"{m['digest']}{state}"
        )
    if not store["models"]:
        lines.append("           (empty; `inferd pull smollm2`)")
    for q in store["quantized"]:
        lines.append(
            f"           {q['name']:<22} {q['method']} (group {q['group_size'] or 'row'}) of "
            f"{q['source']} {q['source_digest'][:23]}…"
        )
    hf = store["hf_cache"]
    lines.append(f"hf cache   {hf['path']}: {', '.join(hf['models']) or 'no models'}")
    lines += [
        f"dtype      auto -> {ch['dtype']} ({ch['dtype_reason']})",
        f"kernels    matmul {ch['matmul']}; packed {ch['packed_kernels']}",
        f"           decode ops: {ch['fused_kernels']}",
        f"           ISQ {ch['isq']}",
        f"attention  {ch['attention']}",
        f"isa        this machine: {ch['kernel_isa']}; what each kernel ISA gets:",
        *_isa_lines(ch["isa_table"]),
    ]
    return "\n".join(lines)


def _isa_lines(table: list[dict[str, Any]]) -> list[str]:
    lines = []
    for row in table:
        mark = "*" if row["this_machine"] else " "
        lines += [
            f"         {mark} {row['isa']:<8} ({row['needs']}): dtype {row['dtype']}; "
            f"decode ops: {row['decode_ops']}",
            f"             matmul {row['matmul']}",
            f"             packed {row['packed']}",
        ]
    return lines


def _yes(value: object) -> str:
    return "yes" if value else "no" if value is not None else "?"


def _mb(value: int | None) -> str:
    return "?" if value is None else f"{value / 1024:.1f} GiB"
