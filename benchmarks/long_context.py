"""Decode speed with long contexts: tokens/s once the prompt is in the cache, by context length
and number of streams, inferd in process beside llama-server when one is given.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/long_context.py \\
        [--contexts 1024,4096,8192] [--streams 1,16] [--tokens 32] [--model smollm2] [--shared]
    LLAMA_SERVER=/path/to/llama-server ... (adds llama.cpp's server on the same GGUF)

Each point: ``streams`` greedy requests, each with its own prompt of ``context - tokens - 1``
tokens (its own cache salt, so nothing is shared), are prefilled first, one token each; then
the streams are sent again at once, finding their prompts cached, and generate the last
``tokens`` tokens up to ``context``. Three figures per engine: decode tokens/s, from every
stream's first token to the last token (so the attention over the whole context is what grows
with it); the resume time, from sending the streams to their first tokens (the prompts'
uncached tails: inferd caches whole blocks of 16 tokens, so up to 16 tokens a stream are
computed again; llama-server one or a few); and the prefill time of the first pass, all streams
sent at once (shared: the document's prefill and llama-server's slot copies). Contexts past the
model's positions are dropped with a note (SmolLM2: 8192; 16384 is not allowed).

``--shared``: the streams read one document instead: the same ``context - tokens - 9`` tokens,
then 8 of their own (16 questions about one long text). Each engine prefills the document once:
inferd through its prefix cache (the first stream goes first, the others find its blocks),
llama-server by saving the first slot's KV and restoring it into the others (``/slots``,
``--slot-save-path``); each slot then holds its own copy, as its slots do not share KV.

llama-server gets the same prompts as token ids on ``/completion`` (``-np streams`` slots of
``context + tokens`` each, ``-t`` the threads inferd uses, a fresh server per point), each
stream on its own thread. Each stream's prompt is first prefilled into its own slot
(``id_slot``, one token generated, not timed); then the streams are sent again at once,
``cache_prompt`` reusing the slot's KV (the script checks that at most a few prompt tokens were
evaluated again). Its slots decode in one batch, so the decode rate is the tokens after the
first over the longest ``predicted_ms`` (a slot's time from its first token to its last), and
the resume time is the rest of the wall time from sending to the last reply.

The machine may be loaded by others: the two engines run back to back per point, so read the
ratios more than the absolute figures.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from inferd.bench.process import free_port, run_server
from inferd.bench.sweep import FILLER
from inferd.config import EngineConfig
from inferd.engine.driver import CallerLoop
from inferd.engine.sampling import SamplingParams
from inferd.serving.served import ServedModel, load_model
from inferd.serving.sizing import SizingError
from inferd.source import ModelSource, resolve_source


@dataclass(frozen=True, slots=True)
class Point:
    context: int
    streams: int
    tokens: int
    shared: bool = False  # one document for all streams, their own 8 tokens last

    @property
    def prompt_tokens(self) -> int:
        return self.context - self.tokens - 1


def prompts(served: ServedModel, point: Point) -> list[list[int]]:
    """One prompt of ``point.prompt_tokens`` tokens per stream, each beginning (or, shared,
    ending) differently."""
    base = served.tokenizer.encode(FILLER * (point.context // 8 + 2))
    own = [served.tokenizer.encode(f"Story {i}: ")[:8] for i in range(point.streams)]
    return _arrange(base, own, point)


def _arrange(base: list[int], own: list[list[int]], point: Point) -> list[list[int]]:
    body = base[: point.prompt_tokens - 8]
    return [body + mine if point.shared else mine + body for mine in own]


@dataclass(frozen=True, slots=True)
class Rate:
    prefill: float  # seconds to bring every stream's prompt into the cache (the first pass)
    decode: float  # tokens/s from every stream's first token to the last token
    resume: float  # seconds from sending the streams to every stream's first token


def inferd_decode_rate(served: ServedModel, point: Point) -> Rate:
    """``point`` on an engine stepped by this thread, measured as on llama-server: each prompt
    is prefilled first (one token, timed apart) and left in the prefix cache, as a slot keeps its
    KV; then the streams are sent again at once. (Timing from the first tokens of streams
    prefilled together would not do: the streams whose prefill ends first decode, and finish,
    while the others still prefill; at 16 streams x 16k the timed steps held one or two rows.)"""
    engine = served.engine.engine
    ids_all = prompts(served, point)
    # Shared: one salt, the first stream prefills the document, the others find it cached.
    salts = [None if point.shared else f"long-{uuid.uuid4().hex}" for _ in ids_all]
    waves = [range(1), range(1, len(ids_all))] if point.shared else [range(len(ids_all))]
    prefill = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    began = time.perf_counter()
    for wave in waves:
        for i in wave:
            rid = f"prefill-{i}-{uuid.uuid4().hex}"
            engine.add_request(rid, ids_all[i], prefill, cache_salt=salts[i])
        while engine.has_unfinished():
            engine.step()
    prefilled = time.perf_counter() - began
    before = engine.stats()
    params = SamplingParams(max_tokens=point.tokens, temperature=0, ignore_eos=True)
    sent = time.perf_counter()
    for ids, salt in zip(ids_all, salts, strict=True):
        engine.add_request(f"long-{uuid.uuid4().hex}", ids, params, cache_salt=salt)
    started: set[str] = set()
    while len(started) < point.streams:  # each prompt's uncached tail, then its first token
        started.update(out.request_id for out in engine.step() if out.token_ids)
    first = time.perf_counter()
    generated = 0
    while engine.has_unfinished():
        generated += sum(len(out.token_ids) for out in engine.step())
    decode = generated / (time.perf_counter() - first)
    after = engine.stats()
    computed = (after.prefix_cache_queries - before.prefix_cache_queries) - (
        after.prefix_cache_hits - before.prefix_cache_hits
    )
    block = engine._core.scheduler.kv.block_size
    if computed > point.streams * block:  # more than each prompt's last, partial block
        raise SystemExit(f"inferd computed {computed} prompt tokens again: prefix cache missed")
    return Rate(prefilled, decode, first - sent)


def llama_server_decode_rate(binary: str, gguf: Path, point: Point, threads: int) -> Rate:
    """``point`` on llama-server (module doc), started for this point."""
    port = free_port()
    slot = point.context + 16
    cmd = [
        binary,
        *("-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)),
        *("-t", str(threads), "-np", str(point.streams), "-c", str(point.streams * slot)),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        url = f"http://127.0.0.1:{port}"
        cmd += ["--slot-save-path", tmp]
        with run_server(cmd, url + "/health", Path(tmp) / "llama.log", 600, "llama-server"):
            ids = _token_ids_for(url, point)
            began = time.perf_counter()
            if point.shared:  # the document once, into slot 0, then copied into the others
                _completions(url, ids[:1], 1)
                _post(f"{url}/slots/0?action=save", {"filename": "document.bin"})
                for i in range(1, point.streams):
                    _post(f"{url}/slots/{i}?action=restore", {"filename": "document.bin"})
            _completions(url, ids, 1)  # each prompt into its slot
            prefilled = time.perf_counter() - began
            sent = time.perf_counter()
            results = _completions(url, ids, point.tokens)
            elapsed = time.perf_counter() - sent
    timings = [r["timings"] for r in results]
    evaluated = max(t["prompt_n"] for t in timings)
    if evaluated > 8:
        raise SystemExit(f"llama-server evaluated {evaluated} prompt tokens again: no slot reuse")
    # predicted_ms runs from a slot's first token to its last; the slots decode in one batch.
    decoding = max(t["predicted_ms"] for t in timings) / 1000
    after_first = sum(t["predicted_n"] - 1 for t in timings)
    return Rate(prefilled, after_first / decoding, elapsed - decoding)


def _token_ids_for(url: str, point: Point) -> list[list[int]]:
    """The same kind of prompts, in llama.cpp's own tokenization (one per stream)."""
    text = FILLER * (point.context // 8 + 2)
    base = _post(url + "/tokenize", {"content": text})["tokens"]
    own = [
        _post(url + "/tokenize", {"content": f"Story {i}: "})["tokens"][:8]
        for i in range(point.streams)
    ]
    return _arrange(base, own, point)


def _completions(url: str, prompts: list[list[int]], tokens: int) -> list[dict]:
    """Prompt i on slot i, all at once (a thread each: asyncio's default pool has only
    cpu_count + 4 threads, 6 here, so 16 requests went in waves), keeping each slot's KV for
    the next call."""
    body = {"n_predict": tokens, "temperature": 0, "ignore_eos": True, "cache_prompt": True}
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        calls = [
            pool.submit(_post, url + "/completion", body | {"prompt": p, "id_slot": i})
            for i, p in enumerate(prompts)
        ]
        return [call.result() for call in calls]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=3600) as response:
        result: dict = json.loads(response.read())
        return result


def load_for(
    source: ModelSource, contexts: list[int], streams: int, shared: bool
) -> tuple[ServedModel, list[int]]:
    """The model with room for ``streams`` sequences of the longest context it allows, and
    the contexts that fit."""
    contexts = sorted(contexts)
    while contexts:
        longest = contexts[-1]
        cfg = EngineConfig(
            max_num_seqs=streams,
            max_model_len=longest,
            # Each stream's cached prompt and its decode's blocks, with room to spare.
            kv_cache_tokens=streams * (longest + 64),
            speculative="off",
        )
        try:
            return load_model(source, cfg, progress=False, loop=CallerLoop()), contexts
        except SizingError as exc:  # past the model's positions
            print(f"context {longest} dropped: {exc}")
            contexts.pop()
    raise SystemExit("no context fits this model")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--contexts", default="1024,4096,8192")
    parser.add_argument("--streams", default="1,16")
    parser.add_argument("--tokens", type=int, default=32, help="decode tokens timed per stream")
    parser.add_argument("--shared", action="store_true", help="one document for all streams")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",") if c]
    streams = [int(s) for s in args.streams.split(",") if s]
    source = resolve_source(args.model)
    served, contexts = load_for(source, contexts, max(streams), args.shared)
    binary = os.environ.get("LLAMA_SERVER")
    threads = torch.get_num_threads()
    shared = ", one shared document" if args.shared else ""
    print(f"{args.model}, {threads} threads, {args.tokens} decode tokens per stream timed{shared}")
    print(
        "| context | streams | inferd decode tok/s | llama-server decode tok/s | ratio "
        "| inferd resume s | llama-server resume s | inferd prefill s | llama-server prefill s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for context in contexts:
        for n in streams:
            point = Point(context, n, args.tokens, args.shared)
            ours = inferd_decode_rate(served, point)
            peer = llama_server_decode_rate(binary, source.path, point, threads) if binary else None
            theirs = f"{peer.decode:.1f} | {ours.decode / peer.decode:.2f}x" if peer else "— | —"
            resumed = f"{peer.resume:.2f}" if peer else "—"
            prefilled = f"{peer.prefill:.1f}" if peer else "—"
            print(
                f"| {context} | {n} | {ours.decode:.1f} | {theirs} | {ours.resume:.2f} "
                f"| {resumed} | {ours.prefill:.1f} | {prefilled} |",
                flush=True,
            )
    served.shutdown()


if __name__ == "__main__":
    main()
