"""The real format of media bytes from their magic numbers, and whether a declared type fits.

Decoders are chosen by what the bytes are, never by what a client says they are: a declared
media type (a data URL's, an ``input_audio`` format, a file's extension) is only compared with
the sniffed format, and a disagreement is an error rather than a hint.
"""

from __future__ import annotations

from dataclasses import dataclass

from inferd.media.limits import MediaError


@dataclass(frozen=True, slots=True)
class Format:
    name: str  # short, shown in errors: "PNG", "ZIP archive"
    modality: str  # image | audio | video | container (audio or video) | other
    media_types: tuple[str, ...] = ()  # the declared types that fit it; the first is canonical


PNG = Format("PNG", "image", ("image/png", "image/apng"))
JPEG = Format("JPEG", "image", ("image/jpeg", "image/jpg", "image/pjpeg"))
GIF = Format("GIF", "image", ("image/gif",))
WEBP = Format("WebP", "image", ("image/webp",))
BMP = Format("BMP", "image", ("image/bmp", "image/x-bmp", "image/x-ms-bmp"))
TIFF = Format("TIFF", "image", ("image/tiff", "image/tif"))
WAV = Format("WAV", "audio", ("audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave"))
FLAC = Format("FLAC", "audio", ("audio/flac", "audio/x-flac"))
MP3 = Format("MP3", "audio", ("audio/mpeg", "audio/mp3", "audio/mpeg3", "audio/x-mp3"))
OGG = Format("Ogg", "container", ("audio/ogg", "video/ogg", "audio/opus", "application/ogg"))
MP4 = Format(
    "MP4",
    "container",
    (
        "video/mp4",
        "audio/mp4",
        "audio/m4a",
        "audio/x-m4a",
        "audio/aac",
        "video/quicktime",
        "video/x-m4v",
        "video/3gpp",
        "audio/3gpp",
    ),
)
MATROSKA = Format(
    "WebM/Matroska",
    "container",
    ("video/webm", "audio/webm", "video/x-matroska", "audio/x-matroska"),
)
AVI = Format("AVI", "video", ("video/avi", "video/x-msvideo", "video/msvideo"))

# Formats no decoder here takes, named so an error can say what the bytes really are.
_OTHERS = (
    (b"PK\x03\x04", "ZIP archive"),
    (b"PK\x05\x06", "ZIP archive"),
    (b"%PDF", "PDF document"),
    (b"\x1f\x8b", "gzip archive"),
    (b"7z\xbc\xaf\x27\x1c", "7-Zip archive"),
    (b"Rar!", "RAR archive"),
    (b"\x7fELF", "ELF executable"),
    (b"MZ", "Windows executable"),
    (b"<?xml", "XML document"),
    (b"<svg", "SVG drawing (not decoded: it is a program, not pixels)"),
    (b"{", "JSON text"),
    (b"#EXTM3U", "M3U playlist"),
)

# The media types that say nothing about the format.
GENERIC_TYPES = frozenset(
    {"application/octet-stream", "binary/octet-stream", "image/*", "audio/*", "video/*"}
)


def sniff(data: bytes) -> Format | None:
    """The format of ``data``, or None when it is none this package decodes."""
    head = data[:64]
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return PNG
    if head.startswith(b"\xff\xd8\xff"):
        return JPEG
    if head.startswith((b"GIF87a", b"GIF89a")):
        return GIF
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return WEBP
    if head.startswith(b"RIFF") and head[8:12] == b"WAVE":
        return WAV
    if head.startswith(b"RIFF") and head[8:12] == b"AVI ":
        return AVI
    if head.startswith(b"BM") and len(head) >= 26:
        return BMP
    if head.startswith((b"II*\x00", b"MM\x00*")):
        return TIFF
    if head.startswith(b"fLaC"):
        return FLAC
    if head.startswith(b"OggS"):
        return OGG
    if head[4:8] == b"ftyp":
        return MP4
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return MATROSKA
    if head.startswith(b"ID3") or (len(head) > 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0):
        return MP3
    return None


def describe(data: bytes) -> str:
    """What the bytes look like, for an error message: 'a ZIP archive', 'unrecognized data'."""
    found = sniff(data)
    if found is not None:
        return f"{_article(found.name)} {found.name} file"
    stripped = data[:64].lstrip()  # text formats may start with blanks
    for magic, name in _OTHERS:
        if data.startswith(magic) or (magic[:1] in b"<{" and stripped.startswith(magic)):
            return f"{_article(name)} {name}"
    if not data:
        return "empty"
    return "data in no format this server decodes"


def _article(name: str) -> str:
    return "an" if name[0] in "AEIOU" or name.startswith(("MP", "M3", "SVG", "XML")) else "a"


def sniff_for(data: bytes, modality: str) -> Format:
    """The format of media sent as ``modality``; MediaError when the bytes are something else."""
    found = sniff(data)
    fits = found is not None and (
        found.modality == modality or (found.modality == "container" and modality != "image")
    )
    if not fits:
        raise MediaError(f"the data is {describe(data)}, not {_kind(modality)} this server decodes")
    assert found is not None
    return found


def _kind(modality: str) -> str:
    return {"image": "an image", "audio": "audio", "video": "a video"}.get(modality, modality)


def check_declared(declared: str | None, found: Format) -> None:
    """A declared media type must name the format the bytes are in (generic types pass)."""
    if declared is None:
        return
    media_type = declared.split(";", 1)[0].strip().lower()
    if not media_type or media_type in GENERIC_TYPES or media_type in found.media_types:
        return
    raise MediaError(
        f"the declared media type {media_type[:64]!r} does not match the data, "
        f"which is {_article(found.name)} {found.name} file",
        "media_type_mismatch",
    )
