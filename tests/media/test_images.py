"""Images decode exactly as transformers' load_image leaves them, from real generated files."""

from __future__ import annotations

import hashlib
import io

import numpy as np
from PIL import Image
from transformers.image_utils import load_image

from inferd.media.image import decode_image
from inferd.media.limits import MediaLimits
from tests.media.corpus import Corpus


def test_every_image_equals_transformers_load_image_pixel_for_pixel(media_corpus: Corpus) -> None:
    modes = set()
    for name, path in media_corpus.images.items():
        decoded = decode_image(path.read_bytes())
        with Image.open(path) as opened:  # a path would leave its file open in load_image
            expected = load_image(opened)
        assert decoded.image.mode == "RGB", name
        assert decoded.image.size == expected.size, name
        assert np.array_equal(np.asarray(decoded.image), np.asarray(expected)), name
        modes.add(decoded.original_mode)
    # the corpus really covers the modes that convert differently
    assert {"RGB", "RGBA", "L", "P", "I;16", "CMYK"} <= modes


def test_the_exif_orientation_is_applied(media_corpus: Corpus) -> None:
    path = media_corpus.images["exif-rotated-40x20.jpg"]
    decoded = decode_image(path.read_bytes())
    assert decoded.original_size == (40, 20)
    assert decoded.size == (20, 40)  # orientation 6: shown rotated a quarter turn clockwise
    with Image.open(path) as stored:
        rotated = stored.convert("RGB").transpose(Image.Transpose.ROTATE_270)
    assert np.array_equal(np.asarray(decoded.image), np.asarray(rotated))


def test_alpha_is_dropped_not_composited(media_corpus: Corpus) -> None:
    path = media_corpus.images["rgba-alpha-96x64.png"]
    decoded = decode_image(path.read_bytes())
    with Image.open(path) as stored:
        rgba = np.asarray(stored)
    assert rgba[..., 3].min() == 0  # some pixels fully transparent, yet their colour stays
    assert np.array_equal(np.asarray(decoded.image), rgba[..., :3])


def test_the_digest_is_the_sha256_of_the_bytes_as_sent(media_corpus: Corpus) -> None:
    a = media_corpus.images["rgb-tiny-7x5.png"].read_bytes()
    b = media_corpus.images["rgb-25x19.bmp"].read_bytes()
    assert decode_image(a).digest == hashlib.sha256(a).hexdigest()
    assert decode_image(a).digest == decode_image(bytes(a)).digest
    assert decode_image(a).digest != decode_image(b).digest
    assert decode_image(a).format == "PNG" and decode_image(b).format == "BMP"


def test_a_declared_type_that_fits_passes(media_corpus: Corpus) -> None:
    data = media_corpus.images["rgb-photo-320x240.jpg"].read_bytes()
    for declared in ("image/jpeg", "image/jpg", "IMAGE/JPEG; q=1", "application/octet-stream"):
        assert decode_image(data, declared=declared).format == "JPEG"


def _png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    gradient = np.linspace(0, 255, width * height * 3).reshape(height, width, 3)
    Image.fromarray(gradient.astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_max_edge_scales_the_long_side_down_keeping_the_aspect() -> None:
    """--max-edge: a 400x100 image reaches the model as 80x20, as Pillow's bicubic resize
    of the decoded pixels gives it; one that fits is untouched; the digest stays the bytes'."""
    data = _png(400, 100)
    limits = MediaLimits(max_image_edge=80)
    decoded = decode_image(data, limits)
    assert decoded.image.size == (80, 20)
    full = Image.open(io.BytesIO(data)).convert("RGB")
    expected = np.asarray(full.resize((80, 20), Image.Resampling.BICUBIC))
    assert np.array_equal(np.asarray(decoded.image), expected)
    assert decoded.digest == decode_image(data).digest
    small = _png(60, 30)
    assert decode_image(small, limits).image.size == (60, 30)
    assert limits.fitted(100, 400) == (20, 80) and limits.fitted(3, 1000) == (1, 80)
    assert MediaLimits().fitted(4000, 3000) == (4000, 3000)
