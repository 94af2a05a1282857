"""Real media files for the decoding tests, generated once per session in a temporary folder.

Images by Pillow in several sizes and modes, audio by soundfile (WAV, FLAC, MP3) and PyAV
(AAC in MP4), videos by PyAV at odd frame rates: each carries a known signal (a tone's
frequency, a frame's gray level) that the tests read back. The hostile files are built from
the good ones (cut short, relabelled, headers rewritten) or by hand (a PNG declaring a huge
size over a few bytes of data).
"""

from __future__ import annotations

import io
import struct
import zipfile
import zlib
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import numpy.typing as npt
import soundfile as sf
from PIL import Image

SEED = 14


@dataclass(frozen=True)
class Tone:
    """A sine per channel: what an audio file of the corpus holds."""

    sample_rate: int
    seconds: float
    freqs: tuple[float, ...]  # one per channel
    amplitude: float = 0.5

    def signal(self) -> npt.NDArray[np.float64]:
        t = np.arange(round(self.sample_rate * self.seconds)) / self.sample_rate
        return np.stack([self.amplitude * np.sin(2 * np.pi * f * t) for f in self.freqs])


@dataclass(frozen=True)
class Clip:
    """A video of the corpus: frame i is a uniform gray of level ``gray(i)``."""

    fps: Fraction
    frames: int
    size: tuple[int, int] = (64, 48)
    audio: Tone | None = None
    gop: int | None = None  # frames between keyframes (libx264's default: 250)

    @staticmethod
    def gray(i: int) -> int:
        return 8 + (i * 7) % 240  # 7 levels apart over the first 34 frames


@dataclass(frozen=True)
class Corpus:
    root: Path
    images: dict[str, Path]  # good images, decoded equal to transformers' load_image
    tones: dict[str, tuple[Path, Tone]]  # good audio files and their signal
    clips: dict[str, tuple[Path, Clip]]  # good videos and their frames

    def bytes(self, name: str) -> bytes:
        return (self.root / name).read_bytes()


def build(root: Path) -> Corpus:
    root.mkdir(parents=True, exist_ok=True)
    images = _images(root)
    tones = _audio(root)
    clips = _videos(root)
    _hostile(root, images, tones, clips)
    return Corpus(root, images, tones, clips)


# -- images -------------------------------------------------------------------------------------
def _images(root: Path) -> dict[str, Path]:
    rng = np.random.default_rng(SEED)
    made: dict[str, Image.Image | tuple[Image.Image, dict[str, object]]] = {}
    noise = rng.integers(0, 256, (300, 400, 3), dtype=np.uint8)
    made["rgb-noise-400x300.png"] = Image.fromarray(noise)
    made["rgb-tiny-7x5.png"] = Image.fromarray(noise[:5, :7])
    made["rgb-photo-320x240.jpg"] = Image.fromarray(_gradient(320, 240))
    rgba = np.dstack([_gradient(96, 64), np.linspace(0, 255, 96 * 64).reshape(64, 96)])
    made["rgba-alpha-96x64.png"] = Image.fromarray(rgba.astype(np.uint8))
    made["gray-l-50x70.png"] = Image.fromarray(noise[:70, :50, 0])
    made["gray-l-128x96.jpg"] = Image.fromarray(_gradient(128, 96)[..., 1])
    made["palette-p-60x40.png"] = Image.fromarray(_gradient(60, 40)).quantize(colors=37)
    wide = (np.arange(80 * 30, dtype=np.uint32).reshape(30, 80) * 27 % 65536).astype(np.uint16)
    made["gray16-i16-80x30.png"] = Image.fromarray(wide)
    made["cmyk-48x32.jpg"] = Image.fromarray(_gradient(48, 32)).convert("CMYK")
    made["rgb-33x17.webp"] = Image.fromarray(noise[:17, :33])
    made["rgb-25x19.bmp"] = Image.fromarray(noise[:19, :25])
    made["rgb-21x13.tiff"] = Image.fromarray(noise[:13, :21])
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    made["exif-rotated-40x20.jpg"] = (Image.fromarray(_gradient(40, 20)), {"exif": exif})
    frames = [Image.fromarray(noise[:24, :32]), Image.fromarray(noise[24:48, :32])]
    made["animated-32x24.gif"] = (frames[0], {"save_all": True, "append_images": frames[1:]})
    paths = {}
    for name, item in made.items():
        image, options = item if isinstance(item, tuple) else (item, {})
        path = root / name
        image.save(path, **options)
        paths[name] = path
    return paths


def _gradient(width: int, height: int) -> npt.NDArray[np.uint8]:
    """An image whose corners all differ, so a rotation or flip shows."""
    x = np.linspace(0, 255, width)[None, :].repeat(height, 0)
    y = np.linspace(0, 255, height)[:, None].repeat(width, 1)
    return np.dstack([x, y, (x + y) / 2]).astype(np.uint8)


def png(width: int, height: int, payload: bytes = b"\x00" * 64) -> bytes:
    """A PNG by hand: an RGB header of any size over ``payload`` (far too little data)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body)
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(payload))
        + chunk(b"IEND", b"")
    )


# -- audio --------------------------------------------------------------------------------------
AUDIO = {
    "u8-mono-8k.wav": (Tone(8000, 0.5, (440.0,)), "WAV", "PCM_U8"),
    "s16-mono-16k.wav": (Tone(16000, 1.0, (440.0,)), "WAV", "PCM_16"),
    "s16-stereo-22k.wav": (Tone(22050, 0.75, (440.0, 660.0), 0.4), "WAV", "PCM_16"),
    "s16-stereo-44k.flac": (Tone(44100, 0.6, (330.0, 550.0)), "FLAC", "PCM_16"),
    "mono-24k.mp3": (Tone(24000, 0.8, (500.0,)), "MP3", "MPEG_LAYER_III"),
}


def _audio(root: Path) -> dict[str, tuple[Path, Tone]]:
    made = {}
    for name, (tone, fmt, subtype) in AUDIO.items():
        path = root / name
        sf.write(
            path, tone.signal().T.astype(np.float32), tone.sample_rate, format=fmt, subtype=subtype
        )
        made[name] = (path, tone)
    aac = Tone(16000, 1.0, (440.0,), 0.3)
    path = root / "aac-mono-16k.m4a"
    path.write_bytes(_mp4(None, aac))
    made[path.name] = (path, aac)
    return made


def wav_bytes(tone: Tone, subtype: str = "PCM_16") -> bytes:
    buffer = io.BytesIO()
    sf.write(
        buffer, tone.signal().T.astype(np.float32), tone.sample_rate, format="WAV", subtype=subtype
    )
    return buffer.getvalue()


# -- video --------------------------------------------------------------------------------------
CLIPS = {
    "gray-7.5fps.mp4": Clip(Fraction(15, 2), 20),
    "gray-29.97fps-audio.mp4": Clip(
        Fraction(30000, 1001), 30, audio=Tone(16000, 1.0, (440.0,), 0.3)
    ),
    "gray-25fps-gop6.mp4": Clip(Fraction(25), 33, gop=6),  # keyframes to seek to, B-frames between
}


def _videos(root: Path) -> dict[str, tuple[Path, Clip]]:
    made = {}
    for name, clip in CLIPS.items():
        path = root / name
        path.write_bytes(_mp4(clip, clip.audio))
        made[name] = (path, clip)
    return made


def _mp4(clip: Clip | None, tone: Tone | None) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        if clip is not None:
            video = container.add_stream("libx264", rate=clip.fps)
            video.width, video.height = clip.size
            video.pix_fmt = "yuv420p"
            if clip.gop is not None:
                video.codec_context.gop_size = clip.gop
        if tone is not None:
            audio = container.add_stream("aac", rate=tone.sample_rate)
            audio.layout = "mono"
        if clip is not None:
            width, height = clip.size
            for i in range(clip.frames):
                pixels = np.full((height, width, 3), Clip.gray(i), np.uint8)
                frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
                for packet in video.encode(frame):
                    container.mux(packet)
            for packet in video.encode():
                container.mux(packet)
        if tone is not None:
            samples = tone.signal()[:1].astype(np.float32)
            frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
            frame.sample_rate = tone.sample_rate
            for packet in audio.encode(frame):
                container.mux(packet)
            for packet in audio.encode(None):
                container.mux(packet)
    return buffer.getvalue()


# -- hostile ------------------------------------------------------------------------------------
def _hostile(
    root: Path,
    images: dict[str, Path],
    tones: dict[str, tuple[Path, Tone]],
    clips: dict[str, tuple[Path, Clip]],
) -> None:
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("cat.png", images["rgb-tiny-7x5.png"].read_bytes())
    (root / "zip-named.png").write_bytes(archive.getvalue())
    noise = images["rgb-noise-400x300.png"].read_bytes()
    (root / "truncated.png").write_bytes(noise[: len(noise) // 2])
    rng = np.random.default_rng(SEED)
    (root / "garbage-after-magic.png").write_bytes(b"\x89PNG\r\n\x1a\n" + rng.bytes(300))
    (root / "bomb-100000x100000.png").write_bytes(png(100_000, 100_000))
    (root / "bomb-7000x7000.png").write_bytes(png(7000, 7000))
    (root / "empty-0x0.png").write_bytes(png(0, 0))
    wav = tones["s16-mono-16k.wav"][0].read_bytes()
    (root / "truncated.wav").write_bytes(wav[: len(wav) // 2])
    data_at = wav.index(b"data")
    size = struct.unpack_from("<I", wav, data_at + 4)[0]
    lying = wav[: data_at + 4] + struct.pack("<I", size * 2) + wav[data_at + 8 :]
    (root / "lying-length.wav").write_bytes(lying)
    (root / "no-data-chunk.wav").write_bytes(wav[:data_at])
    (root / "rate-384k.wav").write_bytes(wav_bytes(Tone(384_000, 0.01, (440.0,))))
    flac = tones["s16-stereo-44k.flac"][0].read_bytes()
    (root / "truncated.flac").write_bytes(flac[: len(flac) // 2])
    mp4 = clips["gray-7.5fps.mp4"][0].read_bytes()
    (root / "truncated.mp4").write_bytes(mp4[: len(mp4) // 2])
