"""Peers measured in-process on the same GGUF file, one request at a time.

Each peer is optional: when its package is missing or fails to load, the report says so and
the run goes on. Nothing here is imported unless that peer is asked for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from inferd.bench.stats import RequestTiming, Summary, summarize
from inferd.bench.workloads import Workload

# A peer turns (messages, or a plain prompt, and max_tokens) into text deltas, one per token.
StreamFn = Callable[[list[dict[str, str]] | str, int], Iterator[str]]


def llama_cpp_peer(gguf: Path, threads: int) -> StreamFn:
    from llama_cpp import Llama

    llm: Any = Llama(model_path=str(gguf), n_ctx=4096, n_threads=threads, verbose=False)

    def stream(messages: list[dict[str, str]] | str, max_tokens: int) -> Iterator[str]:
        if isinstance(messages, str):  # a base model: plain completion
            for chunk in llm.create_completion(
                prompt=messages, max_tokens=max_tokens, temperature=0, stream=True
            ):
                if chunk["choices"][0]["text"]:
                    yield chunk["choices"][0]["text"]
            return
        chunks = llm.create_chat_completion(
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
        )
        for chunk in chunks:
            text = chunk["choices"][0]["delta"].get("content")
            if text:
                yield text

    return stream


def mistralrs_peer(gguf: Path) -> StreamFn:
    from mistralrs import ChatCompletionRequest, Runner, Which

    # Typed as Any: the binding's stubs only exist where the peer is installed.
    which: Any = Which.GGUF(
        tok_model_id=None, quantized_model_id=str(gguf.parent), quantized_filename=gguf.name
    )
    runner = Runner(which=which)

    def stream(messages: list[dict[str, str]] | str, max_tokens: int) -> Iterator[str]:
        if isinstance(messages, str):
            raise ValueError("the mistral.rs peer measures chat only")
        request = ChatCompletionRequest(
            model="default", messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True
        )
        chunks: Any = runner.send_chat_completion_request(request)
        for chunk in chunks:
            text = chunk.choices[0].delta.content
            if text:
                yield text

    return stream


def transformers_peer(gguf: Path) -> StreamFn:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
    ).eval()

    def stream(messages: list[dict[str, str]] | str, max_tokens: int) -> Iterator[str]:
        if isinstance(messages, str):  # a base model: the text itself, after BOS
            ids: Any = tok(messages, return_tensors="pt")["input_ids"]
        else:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
        kwargs: dict[str, Any] = {
            "input_ids": ids,
            "max_new_tokens": max_tokens,
            "do_sample": False,
            "streamer": streamer,
            "attention_mask": torch.ones_like(ids),
        }
        worker = threading.Thread(target=model.generate, kwargs=kwargs)
        worker.start()
        yield from (t for t in streamer if t)
        worker.join()

    return stream


PEERS: dict[str, Callable[[Path, int], StreamFn]] = {
    "llama.cpp": llama_cpp_peer,
    "mistral.rs": lambda gguf, threads: mistralrs_peer(gguf),
    "transformers": lambda gguf, threads: transformers_peer(gguf),
}


SERIAL_SAMPLE = 8  # serial throughput does not change with more requests; time does


def run_serial(stream: StreamFn, workload: Workload, engine: str) -> Summary:
    """One request at a time (these peers have no continuous batching in-process).

    A serial peer's aggregate tokens/s is its single-stream rate, so a sample of the workload's
    requests measures it as well as all of them would.
    """
    timings = []
    started = time.perf_counter()
    for index in range(min(workload.requests, SERIAL_SAMPLE)):
        timing = RequestTiming(started=time.perf_counter())
        for _ in stream(workload.request(index), workload.max_tokens):
            now = time.perf_counter()
            if timing.first_token is None:
                timing.first_token = now
            timing.token_times.append(now)
        timing.completed = True
        timings.append(timing)
    return summarize(workload.name, engine, timings, time.perf_counter() - started)
