"""Build real-size Llama checkpoints with random weights, as llama.cpp's own GGUF files.

No trained 1B-8B weights can be downloaded here, and speed and memory do not need trained
weights: this script writes Llama-shaped checkpoints with random weights and turns them into
GGUF files with llama.cpp's own tools, so the files are exactly what the peer would serve.

Shapes (Llama-3.2-1B and Llama-3.1-8B, with llama3 rope scaling as in their configs):

    name  hidden layers heads kv_heads head_dim intermediate vocab   tied  rope (theta, factor)
    1b    2048   16     32    8        64       8192         128256  yes   500000, 32
    8b    4096   32     32    8        128      14336        128256  no    500000, 8

The tokenizer is SmolLM2's (49,152 tokens, read from the smollm2 GGUF in inferd's store by
transformers); the configs say vocab_size 128256 and llama.cpp's converter pads the vocabulary
to that with ``[PAD{i}]`` tokens, so the embedding and output matrices have the real size.
Weights: normal with std 0.02 (linear layers and embeddings), RMSNorm weights 1, bfloat16.

Steps, each skipped when its output exists (cache: ~/.cache/inferd-bench/real-size/):

1. HF checkpoint: config.json, tokenizer files, sharded safetensors written one tensor (and a
   slice of rows) at a time: the 8B model never sits in RAM.
2. ``convert_hf_to_gguf.py --outtype bf16`` from the llama-cpp-python 0.3.36 sdist (its own
   gguf-py on PYTHONPATH).
3. ``llama-quantize`` (built by benchmarks/build_peers.sh in the same tree) to each asked type.

The HF shards are deleted once the bf16 GGUF exists and the bf16 GGUF once every asked
quantization exists, unless ``--keep``. Prints each file's path, size and sha256 (also written to
``manifest.json`` in the cache).

    python benchmarks/real_size_models.py --sizes 1b,8b --quants q4_k_m,q4_0,q8_0
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

CACHE = Path(os.environ.get("INFERD_BENCH_CACHE", Path.home() / ".cache" / "inferd-bench"))
OUT = CACHE / "real-size"
LLAMA_CPP = Path("/tmp/llama-server/llama_cpp_python-0.3.36/vendor/llama.cpp")
SMOLLM2_GGUF = Path.home() / ".cache/inferd/snapshots/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
VOCAB = 128256
STD = 0.02
SHARD_BYTES = 2 << 30  # HF's usual shard size is larger; smaller shards cost nothing here
ROWS_ELEMENTS = 1 << 24  # elements generated per slice of a tensor (64 MiB as float32)
SPM = "sentencepiece>=0.1.98,<0.3.0"  # the sdist's requirements-convert_legacy_llama.txt
QUANTS = {"q4_k_m": "Q4_K_M", "q4_0": "Q4_0", "q8_0": "Q8_0"}


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    rope_factor: float

    def config(self, bos: int, eos: int) -> dict[str, object]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate,
            "vocab_size": VOCAB,
            "tie_word_embeddings": self.tied,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "factor": self.rope_factor,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "bfloat16",
            "bos_token_id": bos,
            "eos_token_id": eos,
        }

    def tensors(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Every weight's name and shape, in HF Llama naming (norms have one dimension)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        yield "model.embed_tokens.weight", (VOCAB, h)
        for i in range(self.layers):
            p = f"model.layers.{i}."
            yield p + "input_layernorm.weight", (h,)
            yield p + "self_attn.q_proj.weight", (q, h)
            yield p + "self_attn.k_proj.weight", (kv, h)
            yield p + "self_attn.v_proj.weight", (kv, h)
            yield p + "self_attn.o_proj.weight", (h, q)
            yield p + "post_attention_layernorm.weight", (h,)
            yield p + "mlp.gate_proj.weight", (self.intermediate, h)
            yield p + "mlp.up_proj.weight", (self.intermediate, h)
            yield p + "mlp.down_proj.weight", (h, self.intermediate)
        yield "model.norm.weight", (h,)
        if not self.tied:
            yield "lm_head.weight", (VOCAB, h)

    def parameters(self) -> int:
        total = 0
        for _, shape in self.tensors():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total


SHAPES = {
    "1b": Shape("1b", 2048, 16, 32, 8, 64, 8192, tied=True, rope_factor=32.0),
    "8b": Shape("8b", 4096, 32, 32, 8, 128, 14336, tied=False, rope_factor=8.0),
}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _write_tensor(out: BinaryIO, shape: tuple[int, ...], seed: int) -> None:
    """Write one bf16 tensor's bytes, a slice of rows at a time (norms are ones)."""
    if len(shape) == 1:
        out.write(torch.ones(shape, dtype=torch.bfloat16).view(torch.uint16).numpy().tobytes())
        return
    rows, cols = shape
    step = max(1, ROWS_ELEMENTS // cols)
    gen = torch.Generator().manual_seed(seed)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        block = torch.empty(n, cols).normal_(0.0, STD, generator=gen).to(torch.bfloat16)
        out.write(block.view(torch.uint16).numpy().tobytes())


def write_safetensors(shape: Shape, directory: Path) -> None:
    """Sharded safetensors plus the index, streamed: the header first (it only needs shapes),
    then each tensor's bytes generated slice by slice."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in shape.tensors():
        nbytes = _numel(dims) * 2
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += nbytes
    weight_map: dict[str, str] = {}
    seed = 0
    for index, shard in enumerate(shards, start=1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, dims in shard:
            nbytes = _numel(dims) * 2
            header[name] = {
                "dtype": "BF16",
                "shape": list(dims),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
            weight_map[name] = file
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        part = directory / (file + ".part")
        with open(part, "wb") as out:
            out.write(struct.pack("<Q", len(raw)))
            out.write(raw)
            for _name, dims in shard:
                seed += 1
                _write_tensor(out, dims, seed)
        part.rename(directory / file)
    total = shape.parameters() * 2
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=1))


def tokenizer_dir() -> Path:
    """SmolLM2's tokenizer as HF files (tokenizer.json, tokenizer_config.json), from its GGUF."""
    directory = OUT / "tokenizer"
    if (directory / "tokenizer.json").exists():
        return directory
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(SMOLLM2_GGUF.parent), gguf_file=SMOLLM2_GGUF.name)
    tmp = directory.with_suffix(".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tok.save_pretrained(str(tmp))
    tmp.rename(directory)
    return directory


def hf_checkpoint(shape: Shape) -> Path:
    directory = OUT / f"llama-{shape.name}-hf"
    if (directory / "model.safetensors.index.json").exists():
        return directory
    tok = tokenizer_dir()
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    for file in tok.iterdir():
        shutil.copy(file, directory / file.name)
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(tok))
    bos = t.bos_token_id if t.bos_token_id is not None else 1
    eos = t.eos_token_id if t.eos_token_id is not None else 2
    (directory / "config.json").write_text(json.dumps(shape.config(bos, eos), indent=1))
    started = time.monotonic()
    write_safetensors(shape, directory)
    print(f"  wrote {directory} in {time.monotonic() - started:.0f} s", flush=True)
    return directory


def converter_deps() -> Path:
    """What the converter imports that inferd's venv lacks (sentencepiece: it tries that vocab
    first and only catches a missing file, not a missing module), installed into the cache."""
    target = CACHE / "convert-deps"
    if not (target / "sentencepiece").exists():
        subprocess.run(
            [*(sys.executable, "-m", "pip", "install", "-q", "--target", str(target)), SPM],
            check=True,
        )
    return target


def bf16_gguf(shape: Shape, llama_cpp: Path, keep: bool) -> Path:
    path = OUT / f"llama-{shape.name}-bf16.gguf"
    if path.exists():
        return path
    hf = hf_checkpoint(shape)
    part = path.with_suffix(".part")
    paths = [str(llama_cpp / "gguf-py"), str(converter_deps())]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    started = time.monotonic()
    subprocess.run(
        [
            sys.executable,
            str(llama_cpp / "convert_hf_to_gguf.py"),
            str(hf),
            *("--outtype", "bf16", "--outfile", str(part)),
        ],
        env=env,
        check=True,
    )
    part.rename(path)
    print(f"  converted {path} in {time.monotonic() - started:.0f} s", flush=True)
    if not keep:
        shutil.rmtree(hf)
    return path


def quantized(shape: Shape, quant: str, llama_cpp: Path, keep: bool) -> Path:
    path = OUT / f"llama-{shape.name}-{quant}.gguf"
    if path.exists():
        return path
    source = bf16_gguf(shape, llama_cpp, keep)  # before the binary: it can build meanwhile
    binary = llama_cpp / "build" / "bin" / "llama-quantize"
    if not binary.exists():
        raise SystemExit(f"{binary} is missing: run benchmarks/build_peers.sh first")
    part = path.with_suffix(".part")
    started = time.monotonic()
    threads = str(os.cpu_count() or 2)
    subprocess.run([str(binary), str(source), str(part), QUANTS[quant], threads], check=True)
    part.rename(path)
    print(f"  quantized {path} in {time.monotonic() - started:.0f} s", flush=True)
    return path


def sha256(path: Path, manifest: dict[str, dict[str, object]]) -> str:
    """The file's sha256, cached in the manifest by size and mtime (hashing 5 GB takes a while)."""
    stat = path.stat()
    known = manifest.get(path.name)
    if known and known.get("size") == stat.st_size and known.get("mtime") == stat.st_mtime:
        return str(known["sha256"])
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1b", help="comma list of: " + ",".join(SHAPES))
    parser.add_argument(
        "--quants", default="q4_k_m,q4_0,q8_0", help="comma list of: " + ",".join(QUANTS)
    )
    parser.add_argument(
        "--llama-cpp", type=Path, default=LLAMA_CPP, help="the sdist's llama.cpp source"
    )
    parser.add_argument("--keep", action="store_true", help="keep the HF shards and the bf16 GGUF")
    args = parser.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    quants = [q for q in args.quants.split(",") if q]
    for items, known in ((sizes, list(SHAPES)), (quants, list(QUANTS))):
        for item in items:
            if item not in known:
                parser.error(f"unknown {item!r}: choose from {', '.join(known)}")
    OUT.mkdir(parents=True, exist_ok=True)
    manifest_path = OUT / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    for size in sizes:
        shape = SHAPES[size]
        print(f"{size}: {shape} ({shape.parameters() / 1e9:.2f} B parameters)", flush=True)
        files = [quantized(shape, q, args.llama_cpp, args.keep) for q in quants]
        bf16 = OUT / f"llama-{size}-bf16.gguf"
        if bf16.exists() and not args.keep:
            bf16.unlink()
        for path in files:
            digest = sha256(path, manifest)
            stat = path.stat()
            manifest[path.name] = {
                "path": str(path),
                "size": stat.st_size,
                "mtime": stat.st_mtime,
                "sha256": digest,
                "shape": size,
                "parameters": shape.parameters(),
            }
            manifest_path.write_text(json.dumps(manifest, indent=1))
            print(f"{path}  {stat.st_size / 2**20:,.1f} MiB  sha256:{digest}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
