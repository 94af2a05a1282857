"""The model-tool commands of ``inferd``: convert, quantize, imatrix, doctor, tune.

Registered by ``cli.py``; each handler imports what it needs when it runs, so that
``inferd --help`` stays quick.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from inferd.config import KV_CACHE_DTYPES, EngineConfig
from inferd.store import DEFAULT_MODEL


def add_tool_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    convert = sub.add_parser(
        "convert", help="write a GGUF model out as a Hugging Face (safetensors) directory"
    )
    convert.add_argument("model", help="a .gguf file or a store name (e.g. smollm2)")
    convert.add_argument("outdir", type=Path, help="the directory to create (must be empty)")
    convert.add_argument(
        "--dtype",
        choices=["f32", "bf16", "f16"],
        default="f32",
        help="weight dtype in model.safetensors (default: f32, which keeps logits identical)",
    )
    convert.set_defaults(func=_convert)

    quantize = sub.add_parser(
        "quantize", help="quantize a model's projections (int8/int4) into the store"
    )
    quantize.add_argument("-m", "--model", default=DEFAULT_MODEL, help=_MODEL_HELP)
    add_revision_arg(quantize)
    quantize.add_argument("--isq", choices=["q8", "q4"], required=True, help=_ISQ_HELP)
    quantize.add_argument(
        "--imatrix",
        type=Path,
        metavar="FILE",
        default=None,
        help="an importance matrix (llama.cpp's GGUF or .dat file, e.g. from `inferd imatrix`): "
        "each group's grid minimises the importance-weighted error; stored as its own entry",
    )
    quantize.add_argument(
        "--force", action="store_true", help="quantize again even if the store has it"
    )
    quantize.set_defaults(func=_quantize)

    imatrix = sub.add_parser(
        "imatrix",
        help="compute a model's importance matrix from calibration text (llama.cpp's format)",
    )
    imatrix.add_argument("-m", "--model", default=DEFAULT_MODEL, help=_MODEL_HELP)
    add_revision_arg(imatrix)
    imatrix.add_argument(
        "--calibration", type=Path, required=True, metavar="FILE", help="a UTF-8 text file"
    )
    imatrix.add_argument(
        "-o",
        "--output",
        type=Path,
        required=True,
        metavar="OUT",
        help="the file to write: llama.cpp's GGUF imatrix (its legacy format for a .dat name)",
    )
    imatrix.add_argument(
        "--chunk-size",
        type=int,
        default=512,
        help="tokens a chunk (each read as a sequence of its own; llama-imatrix's -c)",
    )
    imatrix.add_argument(
        "--chunks", type=int, default=None, help="read at most this many chunks (default: all)"
    )
    imatrix.add_argument(
        "--dtype",
        choices=["f32", "bf16"],
        default="f32",
        help="the compute dtype (default: f32, the statistics of the unrounded model)",
    )
    imatrix.set_defaults(func=_imatrix)

    doctor = sub.add_parser("doctor", help="report this host: torch, CPU features, memory, store")
    doctor.add_argument("--json", action="store_true", help="print JSON")
    doctor.set_defaults(func=_doctor)

    tune = sub.add_parser(
        "tune", help="estimate serve settings (max seqs, KV cache, dtype, ISQ) for this host"
    )
    tune.add_argument("-m", "--model", default=DEFAULT_MODEL, help=_MODEL_HELP)
    add_revision_arg(tune)
    tune.add_argument("--json", action="store_true", help="print JSON")
    tune.add_argument(
        "--emit-config",
        type=Path,
        metavar="FILE",
        default=None,
        help="also write the settings as a models file for `serve --config` (JSON, or .toml)",
    )
    tune.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=EngineConfig().kv_cache_dtype,
        help="the KV cache storage to size for, as `serve --kv-cache-dtype` (auto: the model's "
        "dtype; int8 holds about twice the tokens of bf16)",
    )
    tune.set_defaults(func=_tune)
    for sp in (convert, quantize, imatrix, doctor, tune):
        sp.add_argument("--log-level", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


_MODEL_HELP = (
    "a .gguf file, a model directory, a store name or a Hugging Face repo id from the local "
    f"HF cache (default: {DEFAULT_MODEL})"
)
_ISQ_HELP = "in-situ quantization of every projection: q8 (int8) or q4 (int4, groups of 32)"


def add_model_tool_args(p: argparse.ArgumentParser) -> None:
    """``--isq``, ``--imatrix`` and ``--revision`` for serve and run."""
    p.add_argument("--isq", choices=["q8", "q4"], default=None, help=_ISQ_HELP)
    p.add_argument(
        "--imatrix",
        metavar="FILE",
        default=None,
        help="with --isq: quantize for this importance matrix (llama.cpp's GGUF or .dat file; "
        "the store's entry made with it, if `inferd quantize --imatrix` made one)",
    )
    add_revision_arg(p)


def add_revision_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--revision",
        default=None,
        help="with -m org/name: a branch, tag or commit in the local Hugging Face cache",
    )


def model_id(args: argparse.Namespace) -> str | None:
    """``-m`` with ``--revision`` folded in (``org/name@revision``), as the loaders read it."""
    model: str | None = args.model
    revision: str | None = getattr(args, "revision", None)
    if revision is None:
        return model
    from inferd.hf_cache import is_repo_id, split_revision

    if model is None or not is_repo_id(model):
        raise ValueError("--revision needs -m naming a Hugging Face repo id (org/name)")
    return f"{split_revision(model)[0]}@{revision}"


def print_quantized(home: Path) -> None:
    """`inferd models`' lines for the quantized entries of the store."""
    from inferd.loading.quantize import list_quantized

    for folder, q in list_quantized(home):
        size = sum((folder / rel).stat().st_size for rel in q.files if (folder / rel).is_file())
        matrix = f"  imatrix sha256:{q.imatrix[:16]}…" if q.imatrix else ""
        print(
            f"{q.name:<10} {q.method} of {q.source_name} (group {q.group_size or 'row'}) "
            f"{size / 2**20:8.1f} MiB  source sha256:{q.source_digest[:16]}…{matrix}"
        )


def _convert(args: argparse.Namespace) -> int:
    from inferd.convert import ConvertError, convert_gguf
    from inferd.source import resolve_source

    source = resolve_source(args.model)
    if not source.path.is_file():
        raise ConvertError(f"{args.model}: convert reads a GGUF file ({source.path} is not one)")
    out = convert_gguf(source.path, args.outdir, dtype=args.dtype)
    for p in sorted(out.iterdir()):
        print(f"{p.stat().st_size / 2**20:10.1f} MiB  {p}")
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from inferd.loading.imatrix_file import read_imatrix
    from inferd.loading.quantize import find_quantized
    from inferd.quantize_tool import quantize_to_store
    from inferd.source import resolve_source

    source = resolve_source(model_id(args) or DEFAULT_MODEL)
    imatrix = read_imatrix(args.imatrix) if args.imatrix is not None else None
    digest = imatrix.digest() if imatrix is not None else None
    matrix = f" with imatrix sha256:{digest[:16]}…" if digest else ""
    existing = find_quantized(source.digest, args.isq, imatrix=digest)
    if existing is not None and not args.force:
        print(
            f"{existing[0]}: already in the store "
            f"({args.isq} of sha256:{source.digest[:16]}…{matrix})"
        )
        return 0
    folder, manifest, isq = quantize_to_store(source, args.isq, imatrix=imatrix)
    size = sum((folder / rel).stat().st_size for rel in manifest.files) / 2**20
    flags = f"--isq {args.isq}" + (f" --imatrix {args.imatrix}" if imatrix else "")
    weighted = f", {len(isq.weighted)} of {len(isq.quantized)} by importance" if imatrix else ""
    print(
        f"{folder}: {manifest.method} (group {manifest.group_size or 'row'}) of {source.name} "
        f"sha256:{source.digest[:16]}…{matrix}{weighted}, {size:.1f} MiB; "
        f"`{flags}` now loads it"
    )
    return 0


def _imatrix(args: argparse.Namespace) -> int:
    from inferd.quantize_tool import imatrix_to_file
    from inferd.source import resolve_source

    source = resolve_source(model_id(args) or DEFAULT_MODEL)
    imatrix = imatrix_to_file(
        source,
        args.calibration,
        args.output,
        chunk_size=args.chunk_size,
        max_chunks=args.chunks,
        dtype=args.dtype,
    )
    covered = sum(1 for count in imatrix.counts.values() if count > 0)
    print(
        f"{args.output}: {covered} projections over {imatrix.chunk_count} chunks of "
        f"{imatrix.chunk_size} tokens; imatrix sha256:{imatrix.digest()[:16]}…"
    )
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from inferd.doctor import collect, format_text

    info = collect()
    print(json.dumps(info, indent=2) if args.json else format_text(info))
    return 0


def _tune(args: argparse.Namespace) -> int:
    from inferd.tune import emit_config, format_text, model_shape, recommend

    rec = recommend(
        model_shape(model_id(args) or DEFAULT_MODEL), kv_cache_dtype=args.kv_cache_dtype
    )
    if args.emit_config is not None:
        emit_config(rec, args.emit_config)
        rec["emitted_config"] = str(args.emit_config)
    if args.json:
        print(json.dumps(rec, indent=2))
    else:
        print(format_text(rec))
        if args.emit_config is not None:
            r = rec["recommended"]
            print(
                f"wrote      {args.emit_config} (serve --config {args.emit_config} "
                f"--kv-cache-mb {r['kv_cache_mb']} --block-size {r['block_size']})",
                file=sys.stdout,
            )
    return 0
