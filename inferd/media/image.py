"""Images with Pillow, exactly as transformers' ``load_image`` leaves them.

``load_image`` opens the file, applies the EXIF orientation (``ImageOps.exif_transpose``) and
converts to RGB (``Image.convert("RGB")``: alpha dropped, not composited; palettes expanded;
16-bit grayscale through Pillow's own conversion). Model processors are checked pixel-exact
against transformers downstream, so this does the same two steps and nothing else.

Before any pixel is decoded: the bytes are sniffed (only PNG, JPEG, GIF, WebP, BMP and TIFF are
opened: Pillow's other plugins, EPS above all, are not for untrusted input) and the size from
the header is checked against ``max_image_pixels`` (instead of Pillow's own bomb check, which
only warns below twice its cap). Pillow reads headers lazily, so opening costs a header parse;
``load`` is the decoding. Multi-frame files (GIF, APNG, TIFF) give their
first frame, as ``load_image`` does.
"""

from __future__ import annotations

import io

from PIL import Image, ImageOps

from inferd.media.limits import MediaError, MediaLimits, reason
from inferd.media.sniff import check_declared, sniff_for
from inferd.media.types import DecodedImage, digest_of

# Pillow's plugin id for each sniffed format (its JPEG plugin opens camera MPO files too).
_PILLOW_FORMATS = {
    "PNG": "PNG",
    "JPEG": "JPEG",
    "GIF": "GIF",
    "WebP": "WEBP",
    "BMP": "BMP",
    "TIFF": "TIFF",
}


def _open(data: bytes, pillow_format: str) -> Image.Image:
    """The image's header, read by the plugin of its format as ``Image.open`` reads it, less
    Pillow's decompression-bomb check: a warning below twice ``Image.MAX_IMAGE_PIXELS`` and an
    error above. ``MediaLimits.check_pixels`` on the same header is the one check, always an
    error, and it may be set above or below Pillow's."""
    Image.init()  # loads the plugins, as Image.open does
    factory, _ = Image.OPEN[pillow_format]
    return factory(io.BytesIO(data), "")


def image_size(
    data: bytes, limits: MediaLimits | None = None, declared: str | None = None
) -> tuple[int, int]:
    """(width, height) as stored, from the header alone (no pixel is decoded), checked as
    ``decode_image`` checks it: the format sniffed, the declared type matched, the size
    within ``max_image_pixels``. What an image will cost is known from this before decoding."""
    limits = limits or MediaLimits()
    found = sniff_for(data, "image")
    check_declared(declared, found)
    try:
        with _open(data, _PILLOW_FORMATS[found.name]) as opened:
            size = opened.size
    except (OSError, ValueError, SyntaxError, EOFError, IndexError, KeyError, TypeError) as exc:
        raise MediaError(f"the {found.name} image cannot be decoded: {reason(exc)}") from None
    limits.check_pixels(*size)
    return size


def decode_image(
    data: bytes, limits: MediaLimits | None = None, declared: str | None = None
) -> DecodedImage:
    """Decode one image; MediaError says what is wrong (never another exception)."""
    limits = limits or MediaLimits()
    found = sniff_for(data, "image")
    check_declared(declared, found)
    try:
        with _open(data, _PILLOW_FORMATS[found.name]) as opened:
            original_size = opened.size
            original_mode = opened.mode
            limits.check_pixels(*original_size)
            opened.load()  # the decoding; truncated or corrupt data fails here
            upright = ImageOps.exif_transpose(opened)
            rgb = upright.convert("RGB")
            size = limits.fitted(*rgb.size)
            if size != rgb.size:  # --max-edge: the long side scaled down, aspect kept
                rgb = rgb.resize(size, Image.Resampling.BICUBIC)
    except MediaError:
        raise
    except (
        OSError,
        ValueError,
        SyntaxError,
        EOFError,
        IndexError,
        KeyError,
        TypeError,
        Warning,
    ) as exc:
        # Pillow's errors for truncated or corrupt data are these (SyntaxError for bad headers;
        # a warning such as "Corrupt EXIF data" where warnings are errors)
        raise MediaError(f"the {found.name} image cannot be decoded: {reason(exc)}") from None
    except MemoryError:
        raise MediaError(f"the {found.name} image needs more memory than is free") from None
    return DecodedImage(rgb, digest_of(data), found.name, original_size, original_mode)
