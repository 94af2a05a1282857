"""Time to first token of an image request with and without the encoder cache, and the
throughput of 16 concurrent image+text streams, in process.

    .venv/bin/python benchmarks/vision_cache.py [HF_DIR]

Without HF_DIR it builds the tiny random Idefics3 checkpoint of the tests (needs transformers,
a dev dependency): its figures are about inferd's own overhead (preprocessing, scheduling, the
cache), not about a real model's speed. The prefix cache is off, so that a repeated image is
served by the encoder cache alone; each request has its own text after the image.
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from inferd.config import EngineConfig
from inferd.engine.driver import CallerLoop
from inferd.engine.llm_engine import LLMEngine
from inferd.engine.sampling import SamplingParams
from inferd.serving.served import ServedModel, load_model

REPEATS = 5
STREAMS = 16


def image(seed: int) -> tuple[Image.Image, str]:
    pixels = np.random.default_rng(seed).integers(0, 256, (300, 200, 3), dtype=np.uint8)
    picture = Image.fromarray(pixels, "RGB")
    return picture, hashlib.sha256(picture.tobytes()).hexdigest()


def ttft(served: ServedModel, engine: LLMEngine, rid: str, seed: int) -> float:
    """Seconds from the raw image to the first token (preprocessing included)."""
    started = time.perf_counter()
    ids, media = served.prompt(f"<image>Question {rid}?", [image(seed)])
    engine.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0), media=media)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - started


def throughput(served: ServedModel, engine: LLMEngine, new_tokens: int = 16) -> float:
    """Generated tokens per second over STREAMS image requests admitted together."""
    started = time.perf_counter()
    for n in range(STREAMS):
        ids, media = served.prompt(f"<image>Stream {n}.", [image(100 + n)])
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        engine.add_request(f"s{n}", ids, params, media=media)
    generated = 0
    while engine.has_unfinished():
        generated += sum(len(out.token_ids) for out in engine.step())
    return generated / (time.perf_counter() - started)


def main(directory: Path) -> None:
    cfg = EngineConfig(prefix_caching=False, max_num_seqs=STREAMS, max_num_batched_tokens=2048)
    served = load_model(directory, cfg, progress=False, loop=CallerLoop())
    engine = served.engine.engine
    ttft(served, engine, "warm", seed=0)  # kernels and allocations, once
    cold = [ttft(served, engine, f"cold{i}", seed=10 + i) for i in range(REPEATS)]
    warm = [ttft(served, engine, f"warm{i}", seed=10) for i in range(REPEATS)]
    print(f"model {directory} ({served.config.architecture}, {served.dtype})")
    print(f"TTFT, new image each time:  median {statistics.median(cold) * 1000:.1f} ms")
    print(f"TTFT, image in the encoder cache: median {statistics.median(warm) * 1000:.1f} ms")
    print(f"{STREAMS} concurrent image+text streams: {throughput(served, engine):.0f} tokens/s")
    served.shutdown()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from tests.models.tiny_vlm import save_tiny_idefics3

        with tempfile.TemporaryDirectory() as tmp:
            save_tiny_idefics3(Path(tmp))
            main(Path(tmp))
