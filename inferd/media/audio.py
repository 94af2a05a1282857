"""Audio with soundfile (WAV, FLAC, MP3, Ogg) or PyAV (MP4/M4A, WebM/Matroska audio tracks).

Samples come out as float32 ``[channels, n]`` in [-1, 1] at the file's own rate: integer PCM
divided by its full scale (8-bit WAV is unsigned: ``(x - 128) / 128``; 16-bit: ``x / 32768``),
which is what libsndfile and libswresample both do, so the two libraries agree to the bit.

OpenAI's ``pcm16`` (raw 16-bit little-endian mono at 24 kHz) is taken when declared as such.

Limits come from the header first (sample rate, channels, declared length); then reading stops
one sample past ``max_audio_seconds`` whatever the header said. A WAV whose data chunk claims
more bytes than the file holds, or a FLAC that ends before its declared length, is an error:
libsndfile would otherwise quietly return the shorter audio.

Resampling to a model's rate is ``inferd.media.resample`` (``DecodedAudio.resampled``).
"""

from __future__ import annotations

import io
import struct

import av
import numpy as np
import numpy.typing as npt
import soundfile as sf

from inferd.media.limits import MediaError, MediaLimits, reason
from inferd.media.sniff import (
    AVI,
    FLAC,
    MATROSKA,
    MP3,
    MP4,
    OGG,
    WAV,
    Format,
    check_declared,
    sniff_for,
)
from inferd.media.types import DecodedAudio, digest_of

_SOUNDFILE = (WAV, FLAC, MP3, OGG)
# PyAV demuxers forced by the sniffed format: never let FFmpeg probe untrusted bytes itself
# (its playlist demuxers would open other files or URLs).
DEMUXERS = {MP4.name: "mp4", MATROSKA.name: "matroska", OGG.name: "ogg", AVI.name: "avi"}
_UNKNOWN_WAV_LENGTH = 0xFFFFFFFF  # written by streaming encoders that cannot seek back
# OpenAI's input_audio format "pcm16": raw 16-bit little-endian mono samples at 24 kHz, no header
PCM16_TYPES = frozenset({"audio/pcm16", "audio/pcm"})
PCM16_RATE = 24_000


def decode_audio(
    data: bytes, limits: MediaLimits | None = None, declared: str | None = None
) -> DecodedAudio:
    """Decode one clip's first audio track; MediaError says what is wrong."""
    limits = limits or MediaLimits()
    if declared is not None and declared.split(";", 1)[0].strip().lower() in PCM16_TYPES:
        return decode_pcm16(data, limits)
    found = sniff_for(data, "audio")
    check_declared(declared, found)
    try:
        if found in _SOUNDFILE:
            if found is WAV:
                check_wav_length(data)
            samples, rate = _read_soundfile(data, found, limits)
        else:
            decoded = read_av_audio(data, found, limits)
            assert decoded is not None
            samples, rate = decoded
    except MediaError:
        raise
    except MemoryError:
        raise MediaError(f"the {found.name} audio needs more memory than is free") from None
    except (sf.LibsndfileError, av.FFmpegError, RuntimeError, ValueError, OSError) as exc:
        raise MediaError(f"the {found.name} audio cannot be decoded: {reason(exc)}") from None
    if samples.shape[1] == 0:
        raise MediaError(f"the {found.name} file holds no audio samples")
    return DecodedAudio(samples, rate, digest_of(data), found.name)


def decode_pcm16(data: bytes, limits: MediaLimits) -> DecodedAudio:
    """Headerless PCM: the length alone says how long it is, so it is checked first."""
    if len(data) % 2:
        raise MediaError("pcm16 audio must hold whole 16-bit samples (an even number of bytes)")
    limits.check_audio(PCM16_RATE, len(data) // 2 / PCM16_RATE, 1)
    samples = np.frombuffer(data, "<i2").astype(np.float32) / np.float32(32768)
    if samples.size == 0:
        raise MediaError("the pcm16 audio holds no samples")
    return DecodedAudio(samples[None, :], PCM16_RATE, digest_of(data), "PCM16")


def check_wav_length(data: bytes) -> None:
    """The data chunk must fit in the file (libsndfile would silently read what is there)."""
    offset = 12  # past RIFF <size> WAVE
    while offset + 8 <= len(data):
        chunk, size = data[offset : offset + 4], struct.unpack_from("<I", data, offset + 4)[0]
        body = offset + 8
        if chunk == b"data":
            held = len(data) - body
            if size != _UNKNOWN_WAV_LENGTH and size > held:
                raise MediaError(
                    f"the WAV header declares {size} bytes of audio but the file holds {held}: "
                    "it is truncated or its header is wrong"
                )
            return
        offset = body + size + (size & 1)  # chunks are padded to even sizes
    raise MediaError("the WAV file has no data chunk")


def _read_soundfile(
    data: bytes, found: Format, limits: MediaLimits
) -> tuple[npt.NDArray[np.float32], int]:
    with sf.SoundFile(io.BytesIO(data)) as f:
        rate, channels, declared = int(f.samplerate), int(f.channels), int(f.frames)
        limits.check_audio(rate, declared / rate if rate > 0 else None, channels)
        most = int(limits.max_audio_seconds * rate) + 1
        # a second at a time: memory follows what the file holds, not what its header says
        blocks = []
        n = 0
        for block in f.blocks(blocksize=rate, dtype="float32", always_2d=True):
            blocks.append(block)
            n += block.shape[0]
            if n > most:
                limits.check_audio_seconds(n / rate)
    frames = np.concatenate(blocks) if blocks else np.zeros((0, channels), np.float32)
    # WAV and FLAC headers count their samples exactly; an MP3's or Ogg's count may be
    # libsndfile's estimate (no Xing header), and a cut one plays shorter, as in any player
    if found in (WAV, FLAC) and declared > 0 and n < declared:
        raise MediaError(
            f"the {found.name} audio ends after {n} of the {declared} samples its header "
            "declares: it is truncated"
        )
    return np.ascontiguousarray(frames.T), rate


def read_av_audio(
    data: bytes, found: Format, limits: MediaLimits, required: bool = True
) -> tuple[npt.NDArray[np.float32], int] | None:
    """The first audio track of a container, through PyAV; also a video's sound (then an
    absent track is None rather than an error)."""
    with av.open(io.BytesIO(data), format=DEMUXERS[found.name], mode="r") as container:
        if not container.streams.audio:
            if not required:
                return None
            raise MediaError(f"the {found.name} file has no audio stream")
        stream = container.streams.audio[0]
        if stream.codec_context is None:  # FFmpeg has no decoder for what the stream says
            raise MediaError(f"the {found.name} audio stream's codec cannot be decoded")
        rate = int(stream.codec_context.sample_rate or 0)
        channels = int(stream.codec_context.layout.nb_channels)
        limits.check_audio(rate, _declared_seconds(stream, container), channels)
        most = int(limits.max_audio_seconds * rate) + 1
        # the converter only changes the sample format to float planar (same rate and layout)
        convert = av.AudioResampler(format="fltp", layout=stream.codec_context.layout, rate=rate)
        chunks: list[npt.NDArray[np.float32]] = []
        total = 0
        for frame in container.decode(stream):
            for out in convert.resample(frame):
                chunk = np.asarray(out.to_ndarray(), np.float32)
                chunks.append(chunk)
                total += chunk.shape[1]
            if total > most:
                limits.check_audio_seconds(total / rate)
        for out in convert.resample(None):
            chunks.append(np.asarray(out.to_ndarray(), np.float32))
    if not chunks:
        return np.zeros((channels, 0), np.float32), rate
    samples = np.concatenate(chunks, axis=1).astype(np.float32, copy=False)
    limits.check_audio_seconds(samples.shape[1] / rate)
    return samples, rate


def _declared_seconds(stream: av.audio.stream.AudioStream, container: object) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    duration = getattr(container, "duration", None)
    return duration / av.time_base if duration else None
