"""Time inferd/media's decoding of typical inputs, generated in memory, on this machine.

    .venv/bin/python benchmarks/media_decode.py

A 12 MP JPEG photo, a 1080p H.264 video (10 s at 30 fps, a keyframe a second, sampled at
2 fps: each sample decoded from the keyframe before it), a minute of
stereo 44.1 kHz FLAC (and resampled to 16 kHz mono), and the refusal of a decompression bomb
(a 69-byte PNG declaring 100,000 x 100,000 pixels): what one media part costs the server before
a model sees it. The best of 3 runs each.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from fractions import Fraction

import av
import numpy as np
import soundfile as sf
from PIL import Image

from inferd.media.audio import decode_audio
from inferd.media.image import decode_image
from inferd.media.limits import MediaError
from inferd.media.video import VideoSampling, decode_video
from tests.media.corpus import png


def photo() -> bytes:
    rng = np.random.default_rng(0)
    small = rng.integers(0, 256, (300, 400, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(small).resize((4000, 3000), Image.Resampling.BILINEAR).save(
        buffer, "JPEG", quality=90
    )
    return buffer.getvalue()


def video() -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(30))
        stream.width, stream.height, stream.pix_fmt = 1920, 1080, "yuv420p"
        stream.codec_context.gop_size = 30  # a keyframe a second, as cameras and streams have
        base = np.linspace(0, 255, 1920, dtype=np.float32)[None, :, None]
        for i in range(300):
            pixels = np.broadcast_to((base + i) % 256, (1080, 1920, 3)).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def flac() -> bytes:
    t = np.arange(44100 * 60) / 44100
    stereo = np.stack([np.sin(2 * np.pi * 440 * t), np.sin(2 * np.pi * 660 * t)], axis=1) * 0.4
    buffer = io.BytesIO()
    sf.write(buffer, stereo.astype(np.float32), 44100, format="FLAC")
    return buffer.getvalue()


def best(work: Callable[[], object]) -> float:
    times = []
    for _ in range(3):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def refuse_bomb(data: bytes) -> None:
    try:
        decode_image(data)
    except MediaError:
        return
    raise AssertionError("the bomb was decoded")


def main() -> None:
    jpeg, mp4, audio, bomb = photo(), video(), flac(), png(100_000, 100_000)
    rows = [
        ("12 MP JPEG -> RGB", len(jpeg), best(lambda: decode_image(jpeg))),
        ("1080p 10 s 30 fps -> 20 frames", len(mp4), best(lambda: decode_video(mp4))),
        (
            "1080p 10 s, 1 frame",
            len(mp4),
            best(lambda: decode_video(mp4, sampling=VideoSampling(0.1, 1))),
        ),
        ("60 s stereo FLAC", len(audio), best(lambda: decode_audio(audio))),
        (
            "60 s FLAC -> 16 kHz mono",
            len(audio),
            best(lambda: decode_audio(audio).resampled(16000).mono()),
        ),
        ("decompression bomb refused", len(bomb), best(lambda: refuse_bomb(bomb))),
    ]
    print(f"{'input':34} {'bytes':>10} {'ms':>9}")
    for name, size, seconds in rows:
        print(f"{name:34} {size:>10} {seconds * 1000:>9.1f}")


if __name__ == "__main__":
    main()
