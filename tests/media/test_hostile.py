"""Hostile media: corrupt, truncated, mislabelled, over a limit. Each is a MediaError that says
what is wrong (never another exception, never a hang), raised before any heavy decoding."""

from __future__ import annotations

import numpy as np
import pytest

from inferd.media.decode import decode_media
from inferd.media.limits import MediaError, MediaLimits
from tests.media.corpus import Corpus, png

HOSTILE = [
    # file, sent as, declared type, what the error says, its code
    ("zip-named.png", "image", "image/png", "is a ZIP archive, not an image", "invalid_media"),
    ("truncated.png", "image", None, "PNG image cannot be decoded: image file is truncated", None),
    ("garbage-after-magic.png", "image", None, "PNG image cannot be decoded: broken PNG", None),
    ("empty-0x0.png", "image", None, "the PNG image cannot be decoded", None),
    # far past Pillow's own cap, yet refused by ours from the header: the same error as below
    (
        "bomb-100000x100000.png",
        "image",
        None,
        "100000x100000 = 10000000000 pixels",
        "media_too_large",
    ),
    ("bomb-7000x7000.png", "image", None, "7000x7000 = 49000000 pixels", "media_too_large"),
    (
        "rgb-photo-320x240.jpg",
        "image",
        "image/png",
        "declared media type 'image/png' does not match the data, which is a JPEG file",
        "media_type_mismatch",
    ),
    ("s16-mono-16k.wav", "image", None, "is a WAV file, not an image", None),
    (
        "lying-length.wav",
        "audio",
        None,
        "WAV header declares 64000 bytes of audio but the file holds 32000",
        None,
    ),
    ("truncated.wav", "audio", None, "it is truncated or its header is wrong", None),
    ("no-data-chunk.wav", "audio", None, "the WAV file has no data chunk", None),
    ("rate-384k.wav", "audio", None, "sample rate is 384000 Hz", "media_too_large"),
    ("truncated.flac", "audio", None, "the FLAC audio cannot be decoded", None),
    ("s16-stereo-44k.flac", "audio", "audio/wav", "which is a FLAC file", "media_type_mismatch"),
    ("gray-7.5fps.mp4", "audio", None, "the MP4 file has no audio stream", None),
    ("aac-mono-16k.m4a", "video", None, "the MP4 file has no video stream", None),
    ("truncated.mp4", "video", None, "the MP4 video cannot be decoded", None),
    ("rgb-tiny-7x5.png", "video", None, "is a PNG file, not a video", None),
    ("mono-24k.mp3", "video", None, "is an MP3 file, not a video", None),
]


@pytest.mark.parametrize(
    ("name", "modality", "declared", "says", "code"), HOSTILE, ids=[h[0] for h in HOSTILE]
)
def test_hostile_files_are_refused_saying_why(
    media_corpus: Corpus, name: str, modality: str, declared: str | None, says: str, code: str
) -> None:
    with pytest.raises(MediaError) as info:
        decode_media(media_corpus.bytes(name), modality, declared=declared)
    assert says in str(info.value)
    assert info.value.code == (code or "invalid_media")


def test_empty_data_is_refused() -> None:
    for modality in ("image", "audio", "video"):
        with pytest.raises(MediaError, match="the data is empty"):
            decode_media(b"", modality)
    with pytest.raises(MediaError, match="not decoded by this server"):
        decode_media(b"%PDF-1.7", "file")


@pytest.mark.parametrize(
    ("name", "modality", "limits", "says"),
    [
        ("rgb-noise-400x300.png", "image", MediaLimits(max_image_pixels=119_999), "400x300"),
        ("gray-7.5fps.mp4", "video", MediaLimits(max_image_pixels=3071), "each video frame"),
        ("gray-7.5fps.mp4", "video", MediaLimits(max_video_seconds=2.5), "lasts 2.7 s"),
        ("gray-7.5fps.mp4", "video", MediaLimits(max_video_frames=10), "has 20 frames"),
        ("s16-mono-16k.wav", "audio", MediaLimits(max_audio_seconds=0.5), "lasts 1.0 s"),
        ("s16-stereo-44k.flac", "audio", MediaLimits(max_audio_sample_rate=44099), "44100 Hz"),
        ("aac-mono-16k.m4a", "audio", MediaLimits(max_audio_seconds=0.5), "this server takes"),
        ("mono-24k.mp3", "audio", MediaLimits(max_audio_seconds=0.5), "lasts 0.8 s"),
    ],
)
def test_limits_refuse_from_the_header(
    media_corpus: Corpus, name: str, modality: str, limits: MediaLimits, says: str
) -> None:
    with pytest.raises(MediaError) as info:
        decode_media(media_corpus.bytes(name), modality, limits)
    assert info.value.code == "media_too_large"
    assert says in str(info.value) and "(--max-" in str(info.value)


def test_the_pixel_limit_is_ours_alone_above_or_below_pillows(media_corpus: Corpus) -> None:
    """Pillow warns between Image.MAX_IMAGE_PIXELS and twice that (with warnings as errors
    here, a warning would escape); this server's limit decides alone, both ways."""
    from PIL import Image

    assert Image.MAX_IMAGE_PIXELS is not None
    above = Image.MAX_IMAGE_PIXELS + 1
    side = int(above**0.5) + 1  # a square just past Pillow's warning threshold
    bomb = png(side, side)
    with pytest.raises(MediaError) as info:
        decode_media(bomb, "image")
    assert info.value.code == "media_too_large" and f"{side}x{side}" in str(info.value)
    with pytest.raises(MediaError) as info:  # allowed by us: the header passes, the data is short
        decode_media(bomb, "image", MediaLimits(max_image_pixels=side * side))
    assert info.value.code == "invalid_media"


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="--max-image-pixels must be at least 1"):
        MediaLimits(max_image_pixels=0)
    with pytest.raises(ValueError, match="--max-audio-seconds must be positive"):
        MediaLimits(max_audio_seconds=0)


def test_every_cut_or_flip_of_every_good_file_decodes_or_is_a_media_error(
    media_corpus: Corpus,
) -> None:
    """Truncation anywhere (header, index, data) and bytes changed at random must never escape
    as another exception (warnings are errors here, so none escapes as one either)."""
    files = [
        *((p, "image") for p in media_corpus.images.values()),
        *((p, "audio") for p, _ in media_corpus.tones.values()),
        *((p, "video") for p, _ in media_corpus.clips.values()),
    ]
    rng = np.random.default_rng(14)
    outcomes = {"decoded": 0, "refused": 0}
    for path, modality in files:
        data = path.read_bytes()
        variants = [data[:cut] for cut in {1, 8, 40, *rng.integers(1, len(data), 5).tolist()}]
        for _ in range(12):
            flipped = bytearray(data)
            for at in rng.integers(0, len(data), rng.integers(1, 8)):
                flipped[at] = int(rng.integers(0, 256))
            variants.append(bytes(flipped))
        for variant in variants:
            try:
                decode_media(variant, modality)
                outcomes["decoded"] += 1
            except MediaError:
                outcomes["refused"] += 1
    assert outcomes["refused"] > len(files)  # at least the 1-, 8- and 40-byte cuts
    assert outcomes["decoded"] > 0  # a flip inside pixel or sample data still decodes
