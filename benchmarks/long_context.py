"""Decode speed with long contexts: tokens/s once the prompt is in the cache, by context length
and number of streams, inferd in process beside llama-server when one is given.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/long_context.py \\
        [--contexts 1024,4096,8192] [--streams 1,16] [--tokens 32] [--model smollm2] [--shared]
    LLAMA_SERVER=/path/to/llama-server ... (adds llama.cpp's server on the same GGUF)

Each point: ``streams`` greedy requests, each with its own prompt of ``context - tokens - 1``
tokens (its own cache salt, so nothing is shared), are prefilled first (not timed); then the
last ``tokens`` tokens up to ``context`` are generated and timed: decode tokens/s = streams *
tokens / that time, so the attention over the whole context is what grows with it. Contexts
past the model's positions are dropped with a note (SmolLM2: 8192; 16384 is not allowed).

``--shared``: the streams read one document instead: the same ``context - tokens - 9`` tokens,
then 8 of their own (16 questions about one long text). Each engine prefills the document once:
inferd through its prefix cache (the first stream goes first, the others find its blocks),
llama-server by saving the first slot's KV and restoring it into the others (``/slots``,
``--slot-save-path``); each slot then holds its own copy, as its slots do not share KV. 16
streams of 16k tokens each with their own text would be 16 prefills of 16k per engine: most of
an hour on 2 cores.

llama-server gets the same prompts as token ids on ``/completion`` (``-np streams`` slots of
``context + tokens`` each, ``-t`` the threads inferd uses, a fresh server per point). Each
stream's prompt is first prefilled into its own slot (``id_slot``, one token generated, not
timed); then the streams are sent again at once, ``cache_prompt`` reusing the slot's KV (the
script checks that at most a few prompt tokens were evaluated again), and timed from outside,
from sending to the last reply: decode tokens/s = the tokens generated / that time. (Its own
``predicted_ms`` is not used: at several streams it counts the steps in which the server
prefilled the other slots' prompts.)

The machine may be loaded by others: the two engines run back to back per point, so read the
ratios more than the absolute figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
import urllib.request
import uuid
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


def inferd_decode_rate(served: ServedModel, point: Point) -> float:
    """Decode tokens/s of ``point`` on an engine stepped by this thread."""
    engine = served.engine.engine
    params = SamplingParams(max_tokens=point.tokens + 1, temperature=0, ignore_eos=True)
    ids_all = prompts(served, point)
    # Shared: the first stream prefills the document, the others find it cached.
    waves = [ids_all[:1], ids_all[1:]] if point.shared else [ids_all]
    for wave in waves:
        for ids in wave:
            rid = f"long-{uuid.uuid4().hex}"
            engine.add_request(rid, ids, params, cache_salt=None if point.shared else rid)
        while any(not r.output_token_ids for r in engine._core.requests.values()):
            engine.step()  # prefill, untimed: every stream has its first token
    started = time.perf_counter()
    generated = 0
    while engine.has_unfinished():
        generated += sum(len(out.token_ids) for out in engine.step())
    return generated / (time.perf_counter() - started)


def llama_server_decode_rate(binary: str, gguf: Path, point: Point, threads: int) -> float:
    """Decode tokens/s of ``point`` on llama-server (module doc), started for this point."""
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
            if point.shared:  # the document once, into slot 0, then copied into the others
                asyncio.run(_completions(url, ids[:1], 1))
                _post(f"{url}/slots/0?action=save", {"filename": "document.bin"})
                for i in range(1, point.streams):
                    _post(f"{url}/slots/{i}?action=restore", {"filename": "document.bin"})
            asyncio.run(_completions(url, ids, 1))  # each prompt into its slot, untimed
            started = time.perf_counter()
            results = asyncio.run(_completions(url, ids, point.tokens))
            elapsed = time.perf_counter() - started
    evaluated = max(r["timings"]["prompt_n"] for r in results)
    if evaluated > 8:
        raise SystemExit(f"llama-server evaluated {evaluated} prompt tokens again: no slot reuse")
    return sum(r["timings"]["predicted_n"] for r in results) / elapsed


def _token_ids_for(url: str, point: Point) -> list[list[int]]:
    """The same kind of prompts, in llama.cpp's own tokenization (one per stream)."""
    text = FILLER * (point.context // 8 + 2)
    base = _post(url + "/tokenize", {"content": text})["tokens"]
    own = [
        _post(url + "/tokenize", {"content": f"Story {i}: "})["tokens"][:8]
        for i in range(point.streams)
    ]
    return _arrange(base, own, point)


async def _completions(url: str, prompts: list[list[int]], tokens: int) -> list[dict]:
    """Prompt i on slot i, all at once, keeping each slot's KV for the next call."""
    body = {"n_predict": tokens, "temperature": 0, "ignore_eos": True, "cache_prompt": True}
    calls = [
        asyncio.to_thread(_post, url + "/completion", body | {"prompt": p, "id_slot": i})
        for i, p in enumerate(prompts)
    ]
    return list(await asyncio.gather(*calls))


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
            kv_cache_tokens=streams * (longest + 16),
            speculative="off",
            prefix_caching=shared,
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
    print("| context | streams | inferd decode tok/s | llama-server decode tok/s | ratio |")
    print("|---|---|---|---|---|")
    for context in contexts:
        for n in streams:
            point = Point(context, n, args.tokens, args.shared)
            ours = inferd_decode_rate(served, point)
            peer = llama_server_decode_rate(binary, source.path, point, threads) if binary else None
            theirs = f"{peer:.1f}" if peer else "—"
            ratio = f"{ours / peer:.2f}x" if peer else "—"
            print(f"| {context} | {n} | {ours:.1f} | {theirs} | {ratio} |", flush=True)
    served.shutdown()


if __name__ == "__main__":
    main()
