"""Time to first token of one request holding an image, an audio clip and a video (with text)
on Gemma 4, with and without the encoder cache, in process.

    PYTHONPATH=. .venv/bin/python benchmarks/gemma4_media_ttft.py [HF_DIR] [--repeats N]

Without HF_DIR it builds the tiny random Gemma 4 of the tests (tests/models/tiny_gemma4.py;
needs transformers, a dev dependency): its figures are inferd's own work around a model
(decoding the PNG, WAV and MP4, preparing patches and features, scheduling, the cache), not a
real model's speed. The prefix cache is off, so that repeated media are served by the encoder
cache alone; each request has its own text before the media. Three cases, median of N each:
new media every time, the same media again (encoder cache on), and the same media with the
cache off (``encoder_cache_mb=0``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

from inferd.config import EngineConfig
from inferd.engine.driver import CallerLoop
from inferd.engine.sampling import SamplingParams
from inferd.media.audio import decode_audio
from inferd.media.image import decode_image
from inferd.media.video import decode_video
from inferd.serving.served import ServedModel, load_model

PROMPT = (
    "<start_of_turn>user\nCase {n}. See <|image|>, hear <|audio|> and watch <|video|>: what "
    "happened?<end_of_turn>\n<start_of_turn>model\n"
)


def evidence(seed: int) -> tuple[bytes, bytes, bytes]:
    """A 640x480 PNG, a 3 s WAV and a 4 s MP4 at 8 fps (320x240), each its own for a seed."""
    from tests.media.corpus import Clip, Tone, _mp4, wav_bytes
    from tests.models.test_idefics3_processor import generated
    from tests.server.test_vision_live import png_bytes

    png = png_bytes(generated(480, 640, seed=seed))
    wav = wav_bytes(Tone(16_000, 3.0, (220.0 + seed,)))
    mp4 = _mp4(Clip(fps=Fraction(8), frames=32 + seed % 7, size=(320, 240)), None)
    return png, wav, mp4


def ttft(served: ServedModel, rid: str, media: tuple[bytes, bytes, bytes]) -> float:
    """Seconds from the files' bytes to the first token (decoding and preparing included)."""
    started = time.perf_counter()
    png, wav, mp4 = media
    picture = decode_image(png)
    items = [
        (picture.image, picture.digest),
        decode_audio(wav),
        decode_video(mp4, sampling=served.prompter.video_sampling),
    ]
    ids, inputs = served.prompter.prepare(PROMPT.format(n=rid), items)
    engine = served.engine.engine
    engine.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0), media=inputs)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - started


def measure(directory: Path, repeats: int) -> dict[str, float]:
    """Median TTFT in ms of each case."""
    figures: dict[str, float] = {}
    for cache_mb in (256, 0):
        cfg = EngineConfig(prefix_caching=False, encoder_cache_mb=cache_mb)
        served = load_model(directory, cfg, progress=False, loop=CallerLoop())
        try:
            ttft(served, "warm-up", evidence(0))  # kernels and allocations, once
            same = evidence(1)
            if cache_mb:
                cold = [ttft(served, f"new{i}", evidence(10 + i)) for i in range(repeats)]
                figures["new media each time"] = statistics.median(cold) * 1000
                ttft(served, "first", same)
                hits = [ttft(served, f"hit{i}", same) for i in range(repeats)]
                figures["same media, encoder cache on"] = statistics.median(hits) * 1000
            else:
                misses = [ttft(served, f"miss{i}", same) for i in range(repeats)]
                figures["same media, encoder cache off"] = statistics.median(misses) * 1000
        finally:
            served.shutdown()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", type=Path)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    with tempfile.TemporaryDirectory() as tmp:
        directory = args.directory
        if directory is None:
            from tests.models.tiny_gemma4 import save_tiny_gemma4

            directory = Path(tmp)
            save_tiny_gemma4(directory)
        figures = measure(directory, args.repeats)
    print(f"model {directory}: PNG 640x480 + WAV 3 s + MP4 4 s (320x240) + text, 1 token")
    for case, ms in figures.items():
        print(f"TTFT, {case}: median {ms:.1f} ms")


if __name__ == "__main__":
    main()
