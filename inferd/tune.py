"""``inferd tune [-m MODEL] [--json] [--emit-config FILE]``: settings for this host, estimated
from the model's shape (read from its header, not loaded) and the memory available now.

The estimate, step by step:

1. dtype: what ``--dtype auto`` picks (bf16 where the CPU computes it fast, else f32).
2. weights in memory: where the VNNI kernels run (bf16 on an avx512 VNNI CPU), a GGUF's
   quantized tensors keep only their packed copy: 0.625 bytes a parameter for 4-bit groups
   (Q4_0, Q4_1, Q4_K), 1.0625 for the other types (requantized to int8 groups of 32), scales
   included; its float tensors take the dtype's size. Elsewhere a model takes its parameter
   count times the dtype's size, plus int4/int8 copies of the projections for decode in bf16.
   Under ISQ the projections take 1 byte (q8) or 0.625 bytes (q4) per parameter.
3. quantization: none if the dense weights fit in half of the available memory (the other half
   is for the KV cache and the rest of the system), else q8, else q4.
4. KV cache: half of what remains after the weights and a headroom (10% of available + 512
   MiB), at most what the sequences below could use, at least 64 MiB. Its bytes per token are
   the pool sizing's (serving/sizing.py ``kv_shape``) for ``--kv-cache-dtype``: auto stores K
   and V in the model's dtype, int8 stores per-token-per-head int8 rows with a float16 scale
   each, so about twice (bf16) or four times (f32) the tokens fit in the same memory.
5. max seqs: how many sequences of half the context fit in that cache, capped at 4 per usable
   CPU (past that a CPU decode step gets slower, not wider) and at 64.

Real use differs (prompt lengths, other processes): the numbers are labelled as an estimate.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType

from inferd.config import DEFAULT_MAX_MODEL_LEN
from inferd.doctor import cpu_info, memory_info
from inferd.kernels import int8_dot
from inferd.loading.dequant import FLOAT_TYPES, INT4_GROUP_TYPES
from inferd.models.config import ModelConfig

HEADROOM_MB = 512
BLOCK_SIZE = 16
ISQ_BYTES = {"q8": 1.0, "q4": 0.625}  # per projection weight, scales included


@dataclass(frozen=True, slots=True)
class ModelShape:
    source: str  # what -m names
    kind: str  # GGUF | Plain
    config: ModelConfig
    params: int  # every parameter
    projection_params: int  # the ones ISQ quantizes (and bf16 packs for decode)
    file_mb: float
    # A GGUF's weights as the VNNI kernels keep them (packed, quantized tensors only), in MiB
    # beside the bytes of its float parameters; None for a safetensors directory.
    packed_mb: float | None = None
    float_params: int = 0


def model_shape(source: str) -> ModelShape:
    """Read ``source``'s shape without loading weights (a store name is not pulled)."""
    from inferd.source import resolve_source
    from inferd.store import CATALOG, ModelStore, StoreError

    if source in CATALOG and not Path(source).exists():
        entry = ModelStore().entry_path(source)
        if entry is None:
            raise StoreError(f"{source} is not in the store; `inferd pull {source}` first")
        path = entry
    else:
        path = resolve_source(source).path
    if path.is_dir():
        return _plain_shape(source, path)
    return _gguf_shape(source, path)


def _gguf_shape(source: str, path: Path) -> ModelShape:
    from inferd.loading.gguf import GGUFFile
    from inferd.loading.gguf_model import gguf_config

    gguf = GGUFFile(path)
    infos = gguf.tensor_infos()
    cfg = gguf_config(gguf)
    params = sum(math.prod(i.shape) for i in infos)
    projections = sum(
        math.prod(i.shape)
        for i in infos
        if (i.name.startswith("blk.") and len(i.shape) == 2) or i.name == "output.weight"
    )
    quantized = [i for i in infos if i.qtype not in FLOAT_TYPES]
    packed = sum(math.prod(i.shape) * _packed_bytes(i.qtype) for i in quantized)
    return ModelShape(
        source,
        "GGUF",
        cfg,
        params,
        projections,
        path.stat().st_size / 2**20,
        packed_mb=packed / 2**20,
        float_params=params - sum(math.prod(i.shape) for i in quantized),
    )


def _packed_bytes(qtype: GGMLQuantizationType) -> float:
    """Bytes a parameter of this GGUF type takes packed for the VNNI kernels: 4-bit codes or
    int8 codes, and a float16 scale (and min, for 4 bits) per group of 32."""
    return 0.5 + 4 / 32 if qtype in INT4_GROUP_TYPES else 1 + 2 / 32


def _plain_shape(source: str, path: Path) -> ModelShape:
    from inferd.loading.hf_model import read_model_config
    from inferd.loading.safetensors import SafetensorsCheckpoint

    checkpoint = SafetensorsCheckpoint(path)
    cfg = read_model_config(path, checkpoint)
    shapes = {n: checkpoint.shape(n) for n in checkpoint.names()}
    params = sum(math.prod(s) for s in shapes.values())
    projections = sum(
        math.prod(s)
        for n, s in shapes.items()
        if (len(s) == 2 and ".layers." in n) or n == "lm_head.weight"
    )
    size = sum(f.path.stat().st_size for f in checkpoint.files)
    return ModelShape(source, "Plain", cfg, params, projections, size / 2**20)


def weights_mb(shape: ModelShape, dtype: torch.dtype, isq: str | None, vnni: bool) -> float:
    """The weights' MiB in memory (step 2); ``vnni``: whether the VNNI kernels run them."""
    size = dtype.itemsize
    other = shape.params - shape.projection_params
    if isq is None and shape.packed_mb is not None and vnni:
        return shape.packed_mb + shape.float_params * size / 2**20
    if isq is not None:
        return (other * size + shape.projection_params * ISQ_BYTES[isq]) / 2**20
    packed = shape.projection_params * 1.0 if dtype == torch.bfloat16 else 0.0
    return (shape.params * size + packed) / 2**20


def kv_storage(config: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str) -> tuple[str, int]:
    """How the KV pool stores a token for ``--kv-cache-dtype`` with the model computing in
    ``dtype``: the storage's name and its bytes per token, by the serving's own arithmetic
    (serving/sizing.py), so the estimate matches what serve allocates."""
    from inferd.kernels.kv_quant import cache_dtype, dtype_name
    from inferd.serving.sizing import kv_shape

    stored = cache_dtype(kv_cache_dtype, dtype)
    name = dtype_name(stored)
    return name, kv_shape(config, stored.itemsize, cache_dtype=name).bytes_per_token


def recommend(
    shape: ModelShape,
    *,
    available_mb: int | None = None,
    usable_cpus: int | None = None,
    dtype: torch.dtype | None = None,
    kv_cache_dtype: str = "auto",
    vnni: bool | None = None,
) -> dict[str, Any]:
    """The estimate (see the module docstring); host facts (``vnni`` included: whether the
    VNNI kernels run ``dtype``) default to this machine's.
    ``kv_cache_dtype``: as ``serve --kv-cache-dtype`` (auto, bf16, f32, int8)."""
    from inferd.loading.model import resolve_dtype

    mem = memory_info()
    available = available_mb if available_mb is not None else mem["available_mb"] or 4096
    cpus = usable_cpus or cpu_info()["usable_cpus"]
    dtype = dtype or resolve_dtype("auto")
    cfg = shape.config
    headroom = available * 0.1 + HEADROOM_MB
    vnni = int8_dot(dtype) if vnni is None else vnni
    options = {m: weights_mb(shape, dtype, m, vnni) for m in (None, "q8", "q4")}
    fitting = [m for m, mb in options.items() if mb <= available / 2]
    # Nothing fits half the memory: the smallest (a packed Q4 GGUF is smaller than ISQ makes it).
    isq: str | None = fitting[0] if fitting else min(options, key=lambda m: options[m])
    weights = options[isq]
    fits = bool(fitting) or weights <= available - headroom
    context = min(cfg.max_position, DEFAULT_MAX_MODEL_LEN)
    kv_dtype, per_token = kv_storage(cfg, dtype, kv_cache_dtype)  # what the estimate assumes
    cap_seqs = max(4, min(64, 4 * cpus))
    most = cap_seqs * context * per_token / 2**20  # every sequence at its full context
    kv_mb = int(max(64, min((available - weights - headroom) / 2, most)))
    kv_tokens = int(kv_mb * 2**20 // per_token) // BLOCK_SIZE * BLOCK_SIZE
    max_seqs = max(1, min(cap_seqs, kv_tokens // max(1, context // 2)))
    dtype_name = "bf16" if dtype == torch.bfloat16 else "f32"
    flags = [
        "--dtype",
        dtype_name,
        "--max-seqs",
        str(max_seqs),
        "--max-seq-len",
        str(context),
        "--kv-cache-mb",
        str(kv_mb),
        "--block-size",
        str(BLOCK_SIZE),
        "--kv-cache-dtype",
        kv_dtype,
    ]
    if isq is not None:
        flags += ["--isq", isq]
    return {
        "estimate": True,
        "note": "an estimate from the model's shape and the memory free now; measure real load",
        "model": {
            "source": shape.source,
            "kind": shape.kind,
            "architecture": cfg.architecture,
            "layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "max_position": cfg.max_position,
            "params": shape.params,
            "file_mb": round(shape.file_mb, 1),
            "kv_bytes_per_token": per_token,
        },
        "host": {"available_mb": available, "usable_cpus": cpus},
        "memory_mb": {
            "weights": round(weights, 1),
            "kv_cache": kv_mb,
            "headroom": round(headroom),
            "budget": round(weights + kv_mb + headroom),
            "fits": fits,
        },
        "recommended": {
            "dtype": dtype_name,
            "isq": isq,
            "max_seqs": max_seqs,
            "max_seq_len": context,
            "kv_cache_mb": kv_mb,
            "kv_cache_tokens": kv_tokens,
            "kv_cache_dtype": kv_dtype,
            "block_size": BLOCK_SIZE,
        },
        "serve_flags": flags,
    }


def format_text(rec: dict[str, Any]) -> str:
    m, r, mem = rec["model"], rec["recommended"], rec["memory_mb"]
    lines = [
        f"model      {m['source']}  ({m['kind']}, {m['architecture']}, {m['layers']} layers, "
        f"hidden {m['hidden_size']}, {m['params'] / 1e6:.0f}M params)",
        f"host       {rec['host']['available_mb']} MiB available, "
        f"{rec['host']['usable_cpus']} usable CPUs",
        "ESTIMATE   (from the model's shape and the memory free now; measure real load)",
        f"dtype      {r['dtype']}",
        f"quantize   {r['isq'] or 'none'}  (weights ~{mem['weights']:.0f} MiB"
        f"{'' if mem['fits'] else ', which may NOT fit'})",
        f"memory     budget ~{mem['budget']} MiB: weights ~{mem['weights']:.0f} + KV cache "
        f"{r['kv_cache_mb']} + headroom {mem['headroom']} MiB, of "
        f"{rec['host']['available_mb']} MiB available",
        f"kv cache   {r['kv_cache_mb']} MiB = {r['kv_cache_tokens']} tokens of "
        f"{r['kv_cache_dtype']} ({m['kv_bytes_per_token']} bytes each), block size "
        f"{r['block_size']}",
        f"max seqs   {r['max_seqs']}  (context {r['max_seq_len']})",
        f"serve      inferd serve -m {m['source']} {' '.join(rec['serve_flags'])}",
    ]
    return "\n".join(lines)


def emit_config(rec: dict[str, Any], path: Path) -> None:
    """Write the recommendation as a models file (JSON, or TOML for ``.toml``) for
    ``inferd serve --config``, the KV cache dtype the estimate assumes included; server-wide
    flags (KV cache size, block size) go in a TOML comment and are printed by the command, as
    a models file has no key for them."""
    m, r = rec["model"], rec["recommended"]
    entry: dict[str, Any] = {
        m["kind"]: {"model_id": m["source"]},
        "dtype": r["dtype"],
        "max_seqs": r["max_seqs"],
        "max_seq_len": r["max_seq_len"],
        "kv_cache_dtype": r["kv_cache_dtype"],
    }
    if r["isq"] is not None:
        entry["in_situ_quant"] = r["isq"]
    if path.suffix.lower() == ".toml":
        settings = [f"{k} = {json.dumps(v)}" for k, v in entry.items() if k != m["kind"]]
        text = "\n".join(
            [
                "# written by `inferd tune`: an ESTIMATE from the model's shape and free memory",
                f"# server flags: --kv-cache-mb {r['kv_cache_mb']} --block-size {r['block_size']}",
                "[model]",
                *settings,
                "",
                f"[model.{m['kind']}]",
                f"model_id = {json.dumps(m['source'])}",
            ]
        )
    else:
        text = json.dumps({"model": entry}, indent=2)
    path.write_text(text + "\n", encoding="utf-8")
