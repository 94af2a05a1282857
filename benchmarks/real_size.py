"""inferd against llama-server on one real-size GGUF, side by side in one run (issue 32).

The model is one of benchmarks/real_size_models.py's (default: the Llama-3.2-1B-shaped Q4_K_M,
random weights, SmolLM2's tokenizer with the vocabulary padded to 128,256). Each engine serves
it alone, one after another, on the same machine:

- ``inferd``: ``inferd serve -m MODEL --speculative off`` with default flags plus the context and
  the streams the workloads need (``--max-seqs``, ``--max-seq-len``, ``--kv-cache-tokens``);
  ``inferd+ngram``: the same with ``--speculative ngram`` (inferd's default; random weights make
  its acceptance meaningless, so it is reported apart);
- ``llama-server``: llama.cpp built for this CPU (GGML_NATIVE=ON, benchmarks/build_peers.sh),
  ``-np SLOTS -c KV --kv-unified -t THREADS``: one KV pool shared by the slots, as inferd's is;
- ``llama-server-portable``: the GGML_NATIVE=OFF (AVX2 + AVX-512) build, for comparison.

Measured, each a median over ``--rounds`` (every request has its own random prompt, so no
prefix cache hits):

- load: seconds from start to ready; RSS once ready and its peak while loading (VmRSS and VmHWM
  of /proc/PID/status), and the peak over the whole run;
- single-stream decode: non-streaming requests with ``ignore_eos``; tokens/s =
  (G - 1) / (T(G tokens) - T(1 token)) for two requests with same-length prompts, so the
  prompt's prefill is taken out; and that figure as a fraction of the memory-bandwidth limit:
  bandwidth / bytes read per token, where bytes read per token are the GGUF's tensor bytes that
  a decode step reads (every tensor but the input embedding, which is read a row at a time,
  unless it is also the output matrix): the same figure for both engines, the file's own;
- N streams: N concurrent streaming requests (inferd.bench.http.run_http), aggregate
  completion tokens / wall seconds;
- prefill: one request of exactly P prompt tokens (random token ids; the servers' own
  usage.prompt_tokens is checked) and ``max_tokens`` 1: TTFT = its latency and prefill
  tokens/s = P / TTFT, also as a fraction of the measured bf16 and int8 matmul peaks (FLOPs
  per prompt token = 2 x the layers' matmul weights, attention left out: a lower bound);
- safety: the server under test is killed (its row says so) when the machine's MemAvailable falls
  under ``--min-available-mb`` (1 GiB), so an engine too big for the machine fails alone;
- the machine: read bandwidth (a multi-threaded torch sum over 1 GiB, GB/s) and bf16 / int8
  matmul peaks (2048^3 torch matmuls in fresh processes: with every oneDNN ISA, AMX included
  where the CPU has it, and capped at AVX512_CORE_BF16 as inferd caps itself), measured in the
  same run before the servers start.

    python benchmarks/real_size.py                       # the 1B Q4_K_M, everything
    python benchmarks/real_size.py --rounds 1 --streams 16 --prompts 512,2048   # a smoke test

Writes a markdown table (``--markdown``, default benchmarks/real_size.md) and ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import torch

from inferd.bench.http import run_http
from inferd.bench.process import free_port, run_server, serve_subprocess
from inferd.bench.workloads import Workload

CACHE = Path(os.environ.get("INFERD_BENCH_CACHE", Path.home() / ".cache" / "inferd-bench"))
DEFAULT_MODEL = CACHE / "real-size" / "llama-1b-q4_k_m.gguf"
LLAMA_CPP = Path("/tmp/llama-server/llama_cpp_python-0.3.36/vendor/llama.cpp")
NATIVE = LLAMA_CPP / "build" / "bin" / "llama-server"
PORTABLE = LLAMA_CPP / "build-portable" / "bin" / "llama-server"
ENGINES = ("inferd", "inferd+ngram", "llama-server", "llama-server-portable")
# Prompt token ids drawn from SmolLM2's ordinary tokens (its specials are the first 17).
TOKEN_LOW, TOKEN_HIGH = 100, 49000
SHORT_PROMPT = 32  # tokens of the decode workloads' prompts


# --- the machine -------------------------------------------------------------------------------


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memory_bandwidth_gbs(threads: int, gib: float = 1.0, repeats: int = 7) -> dict[str, float]:
    """Read bandwidth (a sum over a float32 array far larger than the caches) and copy
    bandwidth (bytes read + written), GB/s, median of ``repeats``."""
    torch.set_num_threads(threads)
    n = int(gib * 2**30) // 4
    a = torch.ones(n, dtype=torch.float32)
    b = torch.empty_like(a)
    read = _median_seconds(lambda: a.sum(), repeats)
    copy = _median_seconds(lambda: b.copy_(a), repeats)
    return {"read_gbs": n * 4 / read / 1e9, "copy_gbs": 2 * n * 4 / copy / 1e9}


def compute_peaks_tflops(threads: int, size: int = 2048, repeats: int = 5) -> dict[str, float]:
    """bf16 matmul and int8 matmul (torch._int_mm) peaks, TFLOP/s (TOP/s), median of
    ``repeats``; an int8 figure of 0 where this torch has no CPU int8 matmul."""
    torch.set_num_threads(threads)
    flops = 2 * size**3
    x = torch.randn(size, size).to(torch.bfloat16)
    y = torch.randn(size, size).to(torch.bfloat16)
    out = {"bf16_tflops": flops / _median_seconds(lambda: x @ y, repeats) / 1e12}
    try:
        xi = torch.randint(-127, 127, (size, size), dtype=torch.int8)
        yi = torch.randint(-127, 127, (size, size), dtype=torch.int8)
        out["int8_tops"] = flops / _median_seconds(lambda: torch._int_mm(xi, yi), repeats) / 1e12
    except (RuntimeError, AttributeError):
        out["int8_tops"] = 0.0
    return out


def machine_peaks(threads: int) -> dict[str, float]:
    """compute_peaks_tflops in a fresh process per oneDNN ISA: every ISA the CPU has (AMX
    where present: the machine's peak), and AVX512_CORE_BF16, the cap inferd sets for itself
    (inferd/__init__.py) and that importing it here would have put on this process too."""
    out: dict[str, float] = {}
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import real_size; "
        "print(json.dumps(real_size.compute_peaks_tflops(int(sys.argv[2]))))"
    )
    for isa, suffix in (("ALL", ""), ("AVX512_CORE_BF16", "_avx512")):
        env = {**os.environ, "ONEDNN_MAX_CPU_ISA": isa}
        done = subprocess.run(
            [sys.executable, "-c", code, str(Path(__file__).parent), str(threads)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        peaks = json.loads(done.stdout.strip().splitlines()[-1])
        out.update({k + suffix: v for k, v in peaks.items()})
    return out


# --- the model ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelFacts:
    path: str
    file_bytes: int
    tensor_bytes: int
    decode_bytes: int  # tensor bytes one decode step reads
    layer_matmul_params: int  # weights of the layers' 2-D tensors (prefill FLOPs = 2x per token)
    shape: dict[str, object]


def model_facts(path: Path) -> ModelFacts:
    from gguf import GGUFReader, LlamaFileType

    reader = GGUFReader(str(path))
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    shape: dict[str, object] = {"architecture": arch}
    for key in (
        "embedding_length",
        "block_count",
        "attention.head_count",
        "attention.head_count_kv",
        "feed_forward_length",
        "rope.freq_base",
    ):
        f = reader.fields.get(f"{arch}.{key}")
        if f is not None:
            shape[key] = f.parts[-1].tolist()[0]
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        shape["vocab"] = len(tokens.data)
    names = {t.name for t in reader.tensors}
    total = sum(int(t.n_bytes) for t in reader.tensors)
    decode = sum(
        int(t.n_bytes)
        for t in reader.tensors
        if not (t.name == "token_embd.weight" and "output.weight" in names)
    )
    matmul = sum(
        int(t.n_elements)
        for t in reader.tensors
        if t.name.startswith("blk.") and len([d for d in t.shape if d > 1]) == 2
    )
    shape["tied_embeddings"] = "output.weight" not in names
    file_type = reader.fields.get("general.file_type")
    if file_type is not None:
        shape["file_type"] = LlamaFileType(int(file_type.parts[-1][0])).name
    return ModelFacts(str(path), path.stat().st_size, total, decode, matmul, shape)


# --- the servers -------------------------------------------------------------------------------


@dataclass(slots=True)
class Memory:
    load_seconds: float = 0.0
    rss_ready_mb: float = 0.0
    peak_load_mb: float = 0.0  # VmHWM when ready: the peak while loading
    # RSS when ready, split: anonymous memory, and pages of mapped files (the GGUF where an
    # engine maps it: shared with the page cache, which the kernel can reclaim and reread)
    anon_ready_mb: float = 0.0
    file_ready_mb: float = 0.0
    peak_run_mb: float = 0.0  # VmHWM at the end of the run
    model_load_seconds: float | None = None  # as the engine's own log says, where it does


def proc_status(pid: int) -> dict[str, float]:
    """VmRSS, VmHWM, RssAnon and RssFile of a process, MiB."""
    out: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) / 1024
    return out


@dataclass(frozen=True, slots=True)
class Sizing:
    threads: int
    slots: int  # streams served at once
    context: int  # longest request: prompt + generation
    kv_tokens: int  # KV pool, shared by all streams


def inferd_command(model: Path, sizing: Sizing, speculative: str) -> list[str]:
    return [
        *("-m", str(model), "--speculative", speculative),
        *("--max-seqs", str(sizing.slots), "--max-seq-len", str(sizing.context)),
        *("--kv-cache-tokens", str(sizing.kv_tokens)),
    ]


def llama_server_command(binary: Path, model: Path, port: int, sizing: Sizing) -> list[str]:
    return [
        str(binary),
        *("-m", str(model), "--host", "127.0.0.1", "--port", str(port)),
        *("-t", str(sizing.threads), "-np", str(sizing.slots)),
        *("-c", str(sizing.kv_tokens), "--kv-unified", "--no-webui"),
    ]


@contextmanager
def started(engine: str, model: Path, sizing: Sizing, log: Path) -> Iterator[tuple[str, int]]:
    """Start ``engine``; yields its base URL (without /v1) and pid once ready."""
    if engine.startswith("inferd"):
        speculative = "ngram" if engine == "inferd+ngram" else "off"
        with serve_subprocess(inferd_command(model, sizing, speculative), log, 900) as (
            url,
            proc,
        ):
            yield url, proc.pid
        return
    binary = NATIVE if engine == "llama-server" else PORTABLE
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = llama_server_command(binary, model, port, sizing)
    with run_server(command, url + "/health", log, 900, engine) as proc:
        yield url, proc.pid


# --- the workloads -----------------------------------------------------------------------------


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n)]


def complete(url: str, prompt: list[int], max_tokens: int) -> tuple[float, dict[str, int]]:
    """One non-streaming completion with ``ignore_eos``: (seconds, usage)."""
    body = {
        "model": "default",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    start = time.perf_counter()
    resp = httpx.post(url + "/v1/completions", json=body, timeout=1800)
    seconds = time.perf_counter() - start
    resp.raise_for_status()
    return seconds, resp.json().get("usage", {})


@dataclass(slots=True)
class EngineResult:
    engine: str
    command: str = ""
    memory: Memory = field(default_factory=Memory)
    decode_tps: float = 0.0  # single stream, prefill taken out
    decode_e2e_tps: float = 0.0  # single stream, G / T(G)
    decode_rounds: list[float] = field(default_factory=list)
    streams_tps: dict[int, float] = field(default_factory=dict)
    streams_incomplete: dict[int, int] = field(default_factory=dict)
    prefill_tps: dict[int, float] = field(default_factory=dict)
    ttft_s: dict[int, float] = field(default_factory=dict)
    prompt_tokens_seen: dict[int, int] = field(default_factory=dict)
    completion_tokens_seen: int = 0
    error: str = ""


def measure_decode(url: str, rng: random.Random, gen: int, rounds: int, r: EngineResult) -> None:
    complete(url, random_prompt(rng, SHORT_PROMPT), 8)  # warm up
    rates, e2e = [], []
    for _ in range(rounds):
        t1, u1 = complete(url, random_prompt(rng, SHORT_PROMPT), 1)
        tg, ug = complete(url, random_prompt(rng, SHORT_PROMPT), gen)
        n1, ng = u1.get("completion_tokens", 1), ug.get("completion_tokens", gen)
        r.completion_tokens_seen = ng
        rates.append((ng - n1) / (tg - t1))
        e2e.append(ng / tg)
    r.decode_rounds = rates
    r.decode_tps = statistics.median(rates)
    r.decode_e2e_tps = statistics.median(e2e)


def measure_streams(
    url: str, rng: random.Random, streams: int, gen: int, rounds: int, r: EngineResult
) -> None:
    rates, incomplete = [], 0
    for _ in range(rounds):
        # Distinct text prompts of random words (run_http sends text): no prefix is shared.
        users = tuple(
            " ".join(f"w{rng.randrange(10**6)}" for _ in range(SHORT_PROMPT // 4))
            for _ in range(streams)
        )
        workload = Workload(f"{streams} streams", streams, streams, gen, text=True, users=users)
        summary = asyncio.run(
            run_http(url + "/v1", "default", workload, r.engine, {"ignore_eos": True})
        )
        rates.append(summary.tokens_per_second)
        incomplete += summary.incomplete
    r.streams_tps[streams] = statistics.median(rates)
    r.streams_incomplete[streams] = incomplete


def measure_prefill(
    url: str, rng: random.Random, tokens: int, rounds: int, r: EngineResult
) -> None:
    times = []
    for _ in range(rounds):
        seconds, usage = complete(url, random_prompt(rng, tokens), 1)
        times.append(seconds)
        r.prompt_tokens_seen[tokens] = int(usage.get("prompt_tokens", -1))
    r.ttft_s[tokens] = statistics.median(times)
    r.prefill_tps[tokens] = tokens / r.ttft_s[tokens]


def warm_page_cache(path: Path) -> None:
    """Read the file once so every engine loads it from the page cache, not the disk."""
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


class MemoryGuard:
    """Kills this process's children (the server under test) when the machine's MemAvailable
    falls below a floor: an engine that needs more RAM than the machine has fails its row
    instead of bringing the OOM killer onto a shared machine."""

    def __init__(self, floor_mb: int) -> None:
        self.floor_mb = floor_mb
        self.tripped = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> MemoryGuard:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(0.25):
            if _available_mb() >= self.floor_mb:
                continue
            self.tripped = True
            for pid in _children():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


def _available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("inf")


def _children() -> list[int]:
    pids: list[int] = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            pids += [int(p) for p in (task / "children").read_text().split()]
    return pids


def run_engine(
    engine: str, args: argparse.Namespace, sizing: Sizing, log_dir: Path
) -> EngineResult:
    r = EngineResult(engine)
    rng = random.Random(f"{args.seed}-{engine}")
    log = log_dir / f"{engine}.log"
    warm_page_cache(args.model)
    start = time.perf_counter()
    guard = MemoryGuard(args.min_available_mb)
    try:
        with guard, started(engine, args.model, sizing, log) as (url, pid):
            r.memory.load_seconds = time.perf_counter() - start
            status = proc_status(pid)
            r.memory.rss_ready_mb = status["VmRSS"]
            r.memory.peak_load_mb = status["VmHWM"]
            r.memory.anon_ready_mb = status.get("RssAnon", 0.0)
            r.memory.file_ready_mb = status.get("RssFile", 0.0)
            r.command = " ".join(Path(f"/proc/{pid}/cmdline").read_text().split("\0")).strip()
            print(f"  {engine}: ready in {r.memory.load_seconds:.1f} s, {status}", flush=True)
            measure_decode(url, rng, args.gen, args.rounds, r)
            print(f"  {engine}: decode {r.decode_tps:.2f} tok/s", flush=True)
            for streams in args.streams:
                measure_streams(url, rng, streams, args.stream_gen, args.rounds, r)
                print(
                    f"  {engine}: {streams} streams {r.streams_tps[streams]:.2f} tok/s", flush=True
                )
            for tokens in args.prompts:
                measure_prefill(url, rng, tokens, args.prefill_rounds, r)
                print(
                    f"  {engine}: prefill {tokens}: {r.prefill_tps[tokens]:.1f} tok/s", flush=True
                )
            r.memory.peak_run_mb = proc_status(pid)["VmHWM"]
        # inferd says how long the model itself took (the first start on a machine also builds
        # its kernels, which the start-to-ready figure includes).
        said = re.search(r"loaded \S+ in ([\d.]+)s", log.read_text(errors="replace"))
        r.memory.model_load_seconds = float(said.group(1)) if said else None
    except (RuntimeError, TimeoutError, httpx.HTTPError, OSError) as exc:
        lines = [line for line in str(exc).splitlines() if line.strip()]
        r.error = f"{type(exc).__name__}: {' / '.join(lines[:1] + lines[-2:])[-300:]}"
        if guard.tripped:
            r.error = f"killed: the machine's free memory fell under {guard.floor_mb} MiB"
        print(f"  {engine}: FAILED {r.error}", flush=True)
    return r


# --- the report --------------------------------------------------------------------------------


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or value != value or value == 0 else f"{value:,.{digits}f}"


def markdown(report: dict[str, object], results: list[EngineResult]) -> str:
    facts = report["model"]
    machine = report["machine"]
    assert isinstance(facts, dict) and isinstance(machine, dict)
    bw = float(machine["read_gbs"])
    limit = bw * 1e9 / float(facts["decode_bytes"])
    peak = float(machine["bf16_tflops"]) * 1e12
    peak_int8 = float(machine["int8_tops"]) * 1e12
    flops_per_token = 2 * float(facts["layer_matmul_params"])
    streams = sorted({s for r in results for s in r.streams_tps})
    prompts = sorted({p for r in results for p in r.prefill_tps})
    lines = [
        f"# Real-size model: {Path(str(facts['path'])).name}",
        "",
        f"Generated by `benchmarks/real_size.py` on {report['date']} ({machine['cpu']}, "
        f"{machine['threads']} threads). Model: "
        + ", ".join(f"{k} {v}" for k, v in dict(facts["shape"]).items())
        + "; file "
        f"{int(facts['file_bytes']) / 2**20:,.0f} MiB, read per decode token "
        f"{int(facts['decode_bytes']) / 2**20:,.0f} MiB (the GGUF's tensor bytes, both engines).",
        f"Machine: read bandwidth {bw:.1f} GB/s (copy {float(machine['copy_gbs']):.1f}), so the "
        f"single-stream limit is {limit:.1f} tokens/s; bf16 matmul "
        f"{float(machine['bf16_tflops']):.2f} TFLOP/s, int8 {float(machine['int8_tops']):.2f} "
        f"TOP/s (torch/oneDNN, every ISA; capped at AVX512_CORE_BF16 as inferd caps oneDNN: "
        f"{float(machine['bf16_tflops_avx512']):.2f} and "
        f"{float(machine['int8_tops_avx512']):.2f}). Prefill FLOPs per token: 2 x the layers' "
        f"matmul weights ({flops_per_token / 1e9:.2f} GFLOP; attention left out). "
        f"Rounds: {report['rounds']} (medians); single stream generates "
        f"{report['gen']} tokens, streams {report['stream_gen']} each, with `ignore_eos`.",
        "",
    ]
    head = ["engine", "load s", "RSS ready MiB (anon + file)", "peak load MiB", "peak run MiB"]
    head += ["1 stream tok/s", "of BW limit"]
    head += [f"{s} streams tok/s" for s in streams]
    head += [f"prefill {p} tok/s (TTFT s; of bf16, int8 peak)" for p in prompts]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if r.error:
            lines.append(f"| {r.engine} | failed: {r.error[:120]} |")
            continue
        m = r.memory
        rss = f"{_f(m.rss_ready_mb, 0)} ({_f(m.anon_ready_mb, 0)} + {_f(m.file_ready_mb, 0)})"
        row = [r.engine, _f(m.load_seconds), rss, _f(m.peak_load_mb, 0)]
        row += [_f(m.peak_run_mb, 0), _f(r.decode_tps, 2), f"{r.decode_tps / limit:.0%}"]
        row += [_f(r.streams_tps.get(s), 2) for s in streams]
        for p in prompts:
            tps = r.prefill_tps.get(p)
            frac = (tps or 0) * flops_per_token / peak if peak else 0
            frac8 = (tps or 0) * flops_per_token / peak_int8 if peak_int8 else 0
            row.append(f"{_f(tps)} ({_f(r.ttft_s.get(p), 2)}; {frac:.0%}, {frac8:.0%})")
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "Commands:",
        "",
        *[f"- {r.engine}: `{r.command}`" for r in results if r.command],
        "",
        "Load s: start to ready (inferd's own 'loaded in' figure: "
        + (
            "; ".join(
                f"{r.engine} {r.memory.model_load_seconds:.1f} s"
                for r in results
                if r.memory.model_load_seconds is not None
            )
            or "none ran"
        )
        + "). Random weights: `inferd+ngram`'s acceptance means nothing; its row only shows "
        "what the speculation costs or gives on such text. Prompts are random token ids, "
        "each request its own; prompt_tokens as the servers counted them: "
        + "; ".join(f"{r.engine} {r.prompt_tokens_seen}" for r in results if r.prompt_tokens_seen)
        + ".",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefill-rounds", type=int, default=None, help="default: --rounds")
    parser.add_argument("--gen", type=int, default=128, help="single-stream tokens")
    parser.add_argument("--stream-gen", type=int, default=64, help="tokens per stream")
    parser.add_argument("--streams", default="16,64")
    parser.add_argument("--prompts", default="512,2048,8192")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=Path(__file__).with_name("real_size.md"))
    parser.add_argument(
        "--min-available-mb",
        type=int,
        default=1024,
        help="kill the server under test when MemAvailable falls below this",
    )
    parser.add_argument("--logs", type=Path, default=CACHE / "real-size" / "logs")
    args = parser.parse_args(argv)
    args.streams = [int(s) for s in args.streams.split(",") if s]
    args.prompts = [int(p) for p in args.prompts.split(",") if p]
    args.prefill_rounds = args.prefill_rounds or args.rounds
    engines = [e for e in args.engines.split(",") if e]
    for e in engines:
        if e not in ENGINES:
            parser.error(f"unknown engine {e!r}: choose from {', '.join(ENGINES)}")
    if not args.model.exists():
        parser.error(f"{args.model} is missing: run benchmarks/real_size_models.py first")
    if "llama-server-portable" in engines and not PORTABLE.exists():
        print(f"no portable build at {PORTABLE}: skipped", flush=True)
        engines.remove("llama-server-portable")
    if "llama-server" in engines and not NATIVE.exists():
        parser.error(f"{NATIVE} is missing: run benchmarks/build_peers.sh")
    args.logs.mkdir(parents=True, exist_ok=True)
    # inferd serve inherits it: torch's threads, as many as llama-server's -t.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    max_stream = max(args.streams, default=1)
    longest = max([*args.prompts, SHORT_PROMPT * 4]) + max(args.gen, 8)
    sizing = Sizing(
        threads=args.threads,
        slots=max(max_stream, 1),
        context=longest,
        kv_tokens=max(longest, max_stream * (SHORT_PROMPT * 2 + args.stream_gen)),
    )
    facts = model_facts(args.model)
    print(f"model {facts.path}: {facts.shape}", flush=True)
    machine: dict[str, object] = {
        "cpu": _cpu_name(),
        "threads": args.threads,
        **memory_bandwidth_gbs(args.threads),
        **machine_peaks(args.threads),
    }
    print(f"machine: {machine}", flush=True)
    results = []
    for engine in engines:
        results.append(run_engine(engine, args, sizing, args.logs))
    after = memory_bandwidth_gbs(args.threads)
    machine["read_gbs_after"] = after["read_gbs"]
    report: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "model": asdict(facts),
        "machine": machine,
        "sizing": asdict(sizing),
        "rounds": args.rounds,
        "gen": args.gen,
        "stream_gen": args.stream_gen,
        "results": [asdict(r) for r in results],
    }
    text = markdown(report, results)
    print(text)
    args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


if __name__ == "__main__":
    raise SystemExit(main())
