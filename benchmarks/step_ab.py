"""Batched decode steps of two variants alternating in one process, and their greedy tokens.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/step_ab.py --rows 16 --steps 6 \\
        --switch all --old-kernels /path/to/old/inferd/kernels/decode.cpp [--context 256]

The variants ("before" / "after"): ``onednn`` turns the oneDNN-packed dense weights off / on
(layers/linear.py), ``kernels`` runs the fused kernels built from ``--old-kernels`` / from this
tree's decode.cpp, ``all`` both; ``int4int8`` serves batches past 8 rows from the dense weight /
from the int4 x int8 kernel (layers with it: bf16 int4 weights on the VNNI build); ``int8int8``
serves int8 layers (the output head; Gemma 3's Q4_K/Q6_K layers) from a copy with one scale a
row, weight-only up to 8 rows and dense above, as before the int8 x int8 kernel / from that
kernel; ``int4scales`` gives the int4 x int8 kernel its group scales and mins as float32 (the
kernels from ``--old-kernels``, built before they became float16) / as float16: the same
values, so the same tokens, from fewer bytes; ``stack`` runs decode steps layer by layer / in
one call (models/decode_stack.py). ``--model`` picks another model (default smollm2).
The same requests are stepped with the variants alternating step
by step, so drift of a loaded machine hits both alike; the medians and their ratio are printed.
First, each variant generates ``--rows`` greedy replies of 24 tokens from the start, and the
script says whether the tokens are identical.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import inferd.kernels as kernels
import inferd.layers.linear as linear
from inferd.config import KV_CACHE_DTYPES, EngineConfig
from inferd.engine.driver import CallerLoop
from inferd.engine.llm_engine import LLMEngine
from inferd.engine.sampling import SamplingParams
from inferd.kernels.ops import KernelOps
from inferd.loading.chat_template import NoChatTemplateError
from inferd.serving.served import ServedModel, load_model
from inferd.source import resolve_source

FILLER = "The keeper climbed the stairs, trimmed the wick and wound the clockwork. "


def ops_built_from(source: Path) -> KernelOps:
    """The fused ops compiled from ``source`` (cached by its digest, beside this tree's)."""
    kernels.SOURCE, kernels._tried, kernels._compiled = source, False, None
    return kernels.load_ops(torch.bfloat16)


def start(served: ServedModel, tag: str, rows: int, tokens: int, context: int = 0) -> None:
    """Rows of short chat prompts, or with ``context`` of that many filler tokens each (the
    timed steps then attend over ~context keys a row, as a long conversation's do)."""
    engine = served.engine.engine
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    filler = served.tokenizer.encode(FILLER * (context // 8 + 1))[:context]
    for i in range(rows):
        text = f"Write a story about topic {i}."
        try:
            prompt = filler or served.chat_prompt([{"role": "user", "content": text}]).ids
        except NoChatTemplateError:  # a base model (Gemma 3 270M): the text as it is
            prompt = served.tokenizer.encode(text)
        engine.add_request(f"{tag}-{i}", prompt, params)
    while any(not r.output_token_ids for r in engine._core.requests.values()):
        engine.step()


def finish(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id.split("-")[1], []).extend(out.token_ids)
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--switch",
        choices=["onednn", "kernels", "all", "int4int8", "int8int8", "int4scales", "stack"],
        default="all",
    )
    parser.add_argument("--old-kernels", type=Path, help="decode.cpp of the 'before' build")
    parser.add_argument("--threads", type=int)
    parser.add_argument(
        "--context", type=int, default=0, help="filler prompt tokens of the timed rows"
    )
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ops: dict[bool, KernelOps] = {}
    if args.switch not in ("onednn", "int4int8", "int8int8", "stack"):
        if args.old_kernels is None:
            parser.error("--switch kernels/all needs --old-kernels")
        new = kernels.SOURCE
        ops = {False: ops_built_from(args.old_kernels), True: ops_built_from(new)}
    if args.switch in ("int4int8", "int8int8"):  # read when the weights are packed
        os.environ[kernels.INT4_INT8_ENV] = "1"
    cfg = EngineConfig(
        speculative="off",
        max_num_seqs=max(16, args.rows),
        prefix_caching=False,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    served = load_model(resolve_source(args.model), cfg, progress=False, loop=CallerLoop())
    engine = served.engine.engine

    vnni = [
        m
        for m in engine.model.modules()
        if isinstance(m, linear.Linear) and m.packed_kind is linear.PackedKind.INT4_VNNI
    ]
    if args.switch in ("int4int8", "int4scales") and not vnni:
        parser.error("no layer runs the int4 x int8 kernel here (bf16 int4 weights, VNNI)")
    # int4scales: the same scales and mins as float32 for the old kernels (which read them so)
    scales: dict[linear.Linear, dict[bool, Any]] = {}
    for m in vnni if args.switch == "int4scales" else ():
        assert m._scales is not None
        scales[m] = {False: m._scales.float(), True: m._scales}
    # int8int8: each int8 x int8 layer (the output head) against the int8 weight-only copy of
    # the same weight with the default small batch (dense bf16 above it), as before the kernel.
    packs: dict[linear.Linear, dict[bool, tuple[linear.PackedKind, Any, Any, int]]] = {}
    for m in engine.model.modules() if args.switch == "int8int8" else ():
        if isinstance(m, linear.Linear) and m.packed_kind is linear.PackedKind.INT8_VNNI:
            q8, scales = linear.pack_int8(m.weight.float(), m.weight.dtype)
            packs[m] = {
                False: (linear.PackedKind.INT8, q8, scales, linear.DEFAULT_SMALL_BATCH),
                True: (m.packed_kind, m._packed, m._scales, m.small_batch),
            }
    if args.switch == "int8int8" and not packs:
        parser.error("no layer runs the int8 x int8 kernel here (bf16 int8 weights, VNNI)")

    def switch(after: bool) -> None:
        if args.switch == "int4int8":
            for m in vnni:
                m.small_batch = linear.INT4_INT8_ROWS if after else linear.DEFAULT_SMALL_BATCH
        elif args.switch == "int8int8":
            for m, states in packs.items():
                m.packed_kind, m._packed, m._scales, m.small_batch = states[after]
        elif args.switch == "int4scales":
            for m, states in scales.items():
                m._scales = states[after]
        elif args.switch == "stack":
            engine.model.stack_enabled = after
        elif args.switch != "kernels":
            linear._ONEDNN = after
        if ops:
            engine.model.use_kernels(ops[after])

    replies = {}
    for after in (False, True):
        switch(after)
        start(served, f"t{after}", args.rows, 24)
        replies[after] = finish(engine)
    print("greedy tokens identical:", replies[False] == replies[True])
    start(served, "ab", args.rows, 2 * args.steps + 4, args.context)
    engine.step()
    times: dict[bool, list[float]] = {False: [], True: []}
    attention: dict[bool, list[float]] = {False: [], True: []}  # the kernels' share, a step
    for variant, bucket in attention.items():
        if variant in ops:
            timed_attention(ops[variant], bucket)
    for _ in range(args.steps):
        for after in (False, True):
            switch(after)
            attention[after].append(0.0)
            began = time.perf_counter()
            engine.step()
            times[after].append(time.perf_counter() - began)
    finish(engine)
    before, after_ms = (statistics.median(times[k]) * 1000 for k in (False, True))
    print(
        f"{args.switch}, {args.rows} rows, {torch.get_num_threads()} threads: before "
        f"{before:.2f} ms, after {after_ms:.2f} ms a step ({before / after_ms:.2f}x)"
    )
    if ops and not any(attention[False] + attention[True]):
        # The whole-layer stack calls attention inside its native layer, out of Python's sight.
        print("decode attention: inside the fused layer stack, not timed on its own")
    elif ops:
        before, after_ms = (statistics.median(attention[k]) * 1000 for k in (False, True))
        print(
            f"decode attention in those steps: before {before:.2f} ms, after {after_ms:.2f} ms "
            f"({before / after_ms:.2f}x)"
        )
    served.shutdown()


def timed_attention(ops: KernelOps, bucket: list[float]) -> None:
    """Add each ``decode_attention`` call's seconds to the last entry of ``bucket``."""
    op = ops.decode_attention

    def timed(*args: Any, **kwargs: Any) -> torch.Tensor:
        began = time.perf_counter()
        out = op(*args, **kwargs)
        bucket[-1] += time.perf_counter() - began
        return out

    setattr(ops, "decode_attention", timed)  # noqa: B010 (an instance's, not the class's)


if __name__ == "__main__":
    main()
