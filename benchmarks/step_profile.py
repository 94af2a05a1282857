"""Where a batched decode step spends its time, on the real model (SmolLM2 by default).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/step_profile.py [--rows 1,16,64] [--steps 20]
        [--model smollm2] [--context 64] [--torch-profile]

For each batch size, that many greedy requests are prefilled, then the engine is stepped on
this thread (as under `inferd serve`) through plain decode steps, twice: bare, for the step's
wall time, and with timers around the pieces of the step, for the table. The timers are
exclusive (a piece's children are charged to themselves, not to it), so the rows add up to
the instrumented step; "Python and dispatch in the forward" is what the model's forward spent
outside every timed kernel and matmul (module calls, views, the embedding; the residual
adds run inside the norms: ``add_rms_norm``).
The timers themselves cost a little (a few microseconds per call, ~300 calls a step): compare
the bare and instrumented step times printed under each table. Timers cannot reach inside the
decode stack (models/decode_stack.py: the layers' kernels in one native call), so the
instrumented steps run layer by layer; the bare step is timed both ways, and the stack's saving
comes out of "Python and dispatch in the forward".

The server's part of a token (its JSON chunk and SSE framing, its hand-over to the event loop)
does not run inside a step: it is timed apart on the same outputs and shown under the table,
per step of that many rows. It runs on the HTTP server's thread, which shares the CPU with the
engine on this 2-core machine.

``--torch-profile`` adds torch.profiler's top operators (self CPU time) of the decode steps.
Speculative decoding is off, so every step is one row per request.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

import inferd.engine.core as core_module
from inferd.config import EngineConfig
from inferd.engine.detokenizer import IncrementalDetokenizer
from inferd.engine.driver import CallerLoop
from inferd.engine.llm_engine import LLMEngine
from inferd.engine.outputs import RequestOutput
from inferd.engine.sampling import SamplingParams
from inferd.kernels.ops import KernelOps
from inferd.layers.linear import Linear
from inferd.server import sse
from inferd.serving.served import ServedModel, load_model
from inferd.source import resolve_source

FILLER = "The keeper climbed the stairs, trimmed the wick and wound the clockwork. "

# Rows of the table, in order; the projection names are the model's own module names.
MATMULS = {
    "qkv_proj": "matmul qkv",
    "o_proj": "matmul o",
    "gate_up_proj": "matmul gate_up",
    "down_proj": "matmul down",
    "lm_head": "matmul lm_head (+ float)",
}
OPS = {
    "decode_attention": "attention (paged decode)",
    "rope_write_kv": "rope + kv write",
    "rms_norm": "rms norms (+ residual adds)",
    "add_rms_norm": "rms norms (+ residual adds)",
    "qk_rms_norm": "rms norms (+ residual adds)",
    "silu_mul": "silu or gelu * up",
    "gelu_tanh_mul": "silu or gelu * up",
}
FORWARD_GLUE = "Python and dispatch in the forward"
ORDER = [
    *MATMULS.values(),
    *dict.fromkeys(OPS.values()),
    "rotary tables",
    FORWARD_GLUE,
    "runner: inputs and metadata",
    "runner: execute glue",
    "scheduler: schedule",
    "scheduler: advance",
    "sampling",
    "detokenize",
    "append: stops and outputs",
    "engine step glue",
]


@dataclass
class Timers:
    """Exclusive wall time per label: a timed call's time less that of timed calls inside it."""

    totals: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    _stack: list[list[float]] = field(default_factory=list)  # [start, children] per open call

    def wrap(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            frame = [time.perf_counter(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()
                spent = time.perf_counter() - frame[0]
                self.totals[label] += spent - frame[1]
                if self._stack:
                    self._stack[-1][1] += spent

        return timed


@contextmanager
def patched(target: object, name: str, value: object) -> Iterator[None]:
    saved = target.__dict__.get(name, _MISSING) if hasattr(target, "__dict__") else _MISSING
    setattr(target, name, value)
    try:
        yield
    finally:
        if saved is _MISSING:
            delattr(target, name)
        else:
            setattr(target, name, saved)


_MISSING = object()


@contextmanager
def instrumented(engine: LLMEngine, timers: Timers) -> Iterator[None]:
    """Timers around the pieces of ``engine``'s step (restored on exit)."""
    core = engine._core
    runner, scheduler, model = core.runner, core.scheduler, core.runner.model
    patches: list[tuple[object, str, object]] = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, Linear) and leaf in MATMULS:
            patches.append((module, "forward", timers.wrap(module.forward, MATMULS[leaf])))
    ops = kernel_ops(engine)
    for op, label in OPS.items():
        patches.append((ops, op, timers.wrap(getattr(ops, op), label)))
    patches += [
        (model, "forward", timers.wrap(model.forward, FORWARD_GLUE)),
        (model.rotary, "at", timers.wrap(model.rotary.at, "rotary tables")),
        (model, "compute_logits", timers.wrap(model.compute_logits, MATMULS["lm_head"])),
        (runner, "prepare", timers.wrap(runner.prepare, "runner: inputs and metadata")),
        (runner, "execute", timers.wrap(runner.execute, "runner: execute glue")),
        (scheduler, "schedule", timers.wrap(scheduler.schedule, "scheduler: schedule")),
        (scheduler, "advance", timers.wrap(scheduler.advance, "scheduler: advance")),
        (core_module, "sample", timers.wrap(core_module.sample, "sampling")),
        (core, "_append", timers.wrap(core._append, "append: stops and outputs")),
        (
            IncrementalDetokenizer,
            "push",
            timers.wrap(IncrementalDetokenizer.push, "detokenize"),
        ),
        (core, "step", timers.wrap(core.step, "engine step glue")),
    ]
    with _all_patched(patches):
        yield


def kernel_ops(engine: LLMEngine) -> KernelOps:
    """The kernel ops the model's layers run on (one object, shared by all of them)."""
    layer: Any = engine.model.layers[0]
    ops: KernelOps = layer.self_attn.ops
    return ops


@contextmanager
def _all_patched(patches: list[tuple[object, str, object]]) -> Iterator[None]:
    if not patches:
        yield
        return
    (target, name, value), rest = patches[0], patches[1:]
    with patched(target, name, value), _all_patched(rest):
        yield


@dataclass(frozen=True, slots=True)
class Profile:
    rows: int
    bare_ms: float  # median wall time of an uninstrumented step (decode stack)
    layers_ms: float  # the same, layer by layer (as the instrumented steps run)
    timed_ms: float  # mean wall time of an instrumented step
    parts_ms: dict[str, float]  # per step, by label
    server_ms: dict[str, float]  # per step of ``rows`` outputs, measured apart


def start_requests(served: ServedModel, rows: int, context: int, max_tokens: int) -> list[str]:
    engine = served.engine.engine
    ids = served.tokenizer.encode(FILLER * (context // 8 + 1))[:context]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    rids = []
    for _ in range(rows):
        rid = f"prof-{uuid.uuid4().hex}"
        engine.add_request(rid, ids, params, cache_salt=rid)  # every prompt computed
        rids.append(rid)
    while any(not r.output_token_ids for r in engine._core.requests.values()):
        engine.step()
    return rids


def profile_rows(served: ServedModel, rows: int, steps: int, context: int) -> Profile:
    engine = served.engine.engine
    # Enough tokens that no request ends before the last timed step, however many steps the
    # prompts' prefill took (the first requests decode meanwhile).
    rids = start_requests(served, rows, context, max_tokens=8 * steps + 64)
    outputs: list[RequestOutput] = []
    for _ in range(3):  # warm-up
        outputs = engine.step()
    bare: dict[bool, list[float]] = {True: [], False: []}  # by whether the stack runs
    for _ in range(steps):
        for stack, times in bare.items():
            engine.model.stack_enabled = stack
            started = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - started)
    timers = Timers()
    started = time.perf_counter()
    with instrumented(engine, timers):  # layer by layer (still so from the loop above)
        for _ in range(steps):
            engine.step()
    timed = (time.perf_counter() - started) / steps
    engine.model.stack_enabled = True
    running = sum(rid in engine._core.requests for rid in rids)  # finished ones leave it
    assert running == rows, f"{rows - running} of the {rows} requests ended before the profile"
    for rid in rids:
        engine.abort(rid)
    parts = {label: timers.totals.get(label, 0.0) * 1000 / steps for label in ORDER}
    return Profile(
        rows,
        statistics.median(bare[True]) * 1000,
        statistics.median(bare[False]) * 1000,
        timed * 1000,
        parts,
        server_framing_ms(served, outputs, steps),
    )


def server_framing_ms(
    served: ServedModel, outputs: list[RequestOutput], repeat: int
) -> dict[str, float]:
    """Per step of these outputs: an OpenAI chat chunk each (the envelope, JSON and SSE frame,
    as server/openai_chat.py writes it), and each output's hand-over to the event loop (one
    ``call_soon_threadsafe``, as engine/async_engine.py delivers them)."""
    envelope = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0}
    envelope["model"] = served.id
    started = time.perf_counter()
    for _ in range(repeat):
        for out in outputs:
            body: dict[str, Any] = dict(envelope)
            body["choices"] = [
                {
                    "index": 0,
                    "delta": {"content": out.text},
                    "finish_reason": None,
                    "logprobs": None,
                }
            ]
            sse.event(body)
    framing = (time.perf_counter() - started) / repeat
    loop = asyncio.new_event_loop()
    queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
    started = time.perf_counter()
    for _ in range(repeat):
        for out in outputs:
            loop.call_soon_threadsafe(queue.put_nowait, out)
        loop.run_until_complete(asyncio.sleep(0))
    handover = (time.perf_counter() - started) / repeat
    loop.close()
    return {
        "server: chunk JSON + SSE framing": framing * 1000,
        "server: hand-over to the event loop (+ its wake-up)": handover * 1000,
    }


def render(p: Profile) -> str:
    total = sum(p.parts_ms.values())
    lines = [
        f"### {p.rows} row{'s' if p.rows > 1 else ''} a step",
        "",
        "| part | ms / step | % |",
        "|---|---|---|",
    ]
    for label, ms in p.parts_ms.items():
        lines.append(f"| {label} | {ms:.3f} | {100 * ms / total:.1f}% |")
    lines.append(f"| **step (sum of parts)** | **{total:.2f}** | 100% |")
    lines += [
        "",
        f"bare step (no timers), median: {p.bare_ms:.2f} ms "
        f"({p.rows * 1000 / p.bare_ms:.0f} tokens/s) in the decode stack, "
        f"{p.layers_ms:.2f} ms layer by layer; instrumented (layer by layer): {p.timed_ms:.2f} ms",
        "",
        "| server side, per step (measured apart) | ms / step |",
        "|---|---|",
    ]
    lines += [f"| {label} | {ms:.3f} |" for label, ms in p.server_ms.items()]
    return "\n".join(lines)


def torch_profile(served: ServedModel, rows: int, steps: int, context: int) -> str:
    engine = served.engine.engine
    rids = start_requests(served, rows, context, max_tokens=steps + 8)
    engine.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    for rid in rids:
        engine.abort(rid)
    table: str = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    return f"torch.profiler, {rows} rows, {steps} steps:\n{table}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rows", default="1,16,64", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=20, help="decode steps measured per size")
    parser.add_argument("--context", type=int, default=64, help="prompt tokens of each request")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--torch-profile", action="store_true")
    parser.add_argument("--kv-cache-dtype", default="auto", help="as `inferd serve`'s")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(r) for r in args.rows.split(",") if r]
    cfg = EngineConfig(
        max_num_seqs=max(16, *sizes),
        speculative="off",
        prefix_caching=False,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    served = load_model(resolve_source(args.model), cfg, progress=False, loop=CallerLoop())
    print(
        f"{args.model}, {kernel_ops(served.engine.engine).description}, "
        f"{torch.get_num_threads()} threads, ~{args.context}-token contexts"
    )
    for rows in sizes:
        print()
        print(render(profile_rows(served, rows, args.steps, args.context)))
        if args.torch_profile:
            print()
            print(torch_profile(served, rows, min(args.steps, 10), args.context))
    served.shutdown()


if __name__ == "__main__":
    main()
