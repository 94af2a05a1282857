"""Deterministic fixtures: realistic SSE streams and tiny evidence files.

The streams are built from event lists so tests can mutate one field of one chunk and
re-render; rendering is byte-exact and deterministic. ``EXAMPLE_*`` mirrors a mistral.rs
multimodal answer (usage on the terminal chunk); ``INFERD_*`` mirrors ``inferd serve``
(role chunk, usage null until a choices-free usage chunk after the terminal one).
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from typing import Any

EXAMPLE_BUNDLE = "2" * 64
EXAMPLE_ROUTE = f"/srv/mosaic-models/{EXAMPLE_BUNDLE}"
EXAMPLE_TEXT = "Evidence spans text, image, audio, and video."
INFERD_ROUTE = "SmolLM2-135M-Instruct.Q4_1"
INFERD_TEXT = "Café ✓ — naïve 😀 日本"

# An item is a chunk (dict, sent as one data line), or raw SSE block text (str) such as a
# comment, "data: [DONE]" or a named event.
Item = dict[str, Any] | str


def render(items: list[Item], eol: str = "\n") -> bytes:
    """Serialize items as SSE blocks, each ended by a blank line, with ``eol`` line ends."""
    blocks = []
    for item in items:
        text = item if isinstance(item, str) else "data: " + _compact(item)
        blocks.append(eol.join(text.split("\n")) + eol + eol)
    return "".join(blocks).encode("utf-8")


def _compact(chunk: dict[str, Any]) -> str:
    return json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))


def _chunk(
    route: str,
    rid: str,
    created: int,
    delta: dict[str, Any],
    finish: str | None = None,
    usage: dict[str, int] | None = None,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": route,
        "system_fingerprint": "local",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        "usage": usage,
    }


def example_items() -> list[Item]:
    """A mistral.rs-style answer: keep-alives, 7 text deltas, stop with usage 128 + 9."""
    rid, created = "chatcmpl-8d1c6e0f4b2a4c77", 1767225600
    pieces = ["Evidence", " spans", " text,", " image,", " audio,", " and", " video."]
    items: list[Item] = [": keep-alive"]
    items.append(_chunk(EXAMPLE_ROUTE, rid, created, {"role": "assistant", "content": ""}))
    for i, piece in enumerate(pieces):
        items.append(_chunk(EXAMPLE_ROUTE, rid, created, {"content": piece}))
        if i == 3:
            items.append(": keep-alive")
    usage = {"prompt_tokens": 128, "completion_tokens": 9, "total_tokens": 137}
    items.append(_chunk(EXAMPLE_ROUTE, rid, created, {}, "stop", usage))
    items.append("data: [DONE]")
    return items


def inferd_items(finish: str = "stop", completion_tokens: int = 6) -> list[Item]:
    """An inferd-style answer with multi-byte text and a separate usage chunk."""
    rid, created = "chatcmpl-0f9e8d7c6b5a49382716", 1767225601
    items: list[Item] = []
    items.append(_inferd(rid, created, {"role": "assistant", "content": ""}))
    for piece in ["Café", " ✓", " —", " naïve", " 😀", " 日本"]:
        items.append(_inferd(rid, created, {"content": piece}))
    items.append(_inferd(rid, created, {}, finish))
    usage_chunk: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": INFERD_ROUTE,
        "choices": [],
        "usage": {
            "prompt_tokens": 12,
            "completion_tokens": completion_tokens,
            "total_tokens": 12 + completion_tokens,
        },
    }
    items.append(usage_chunk)
    items.append("data: [DONE]")
    return items


def _inferd(
    rid: str, created: int, delta: dict[str, Any], finish: str | None = None
) -> dict[str, Any]:
    chunk = _chunk(INFERD_ROUTE, rid, created, delta, finish)
    del chunk["system_fingerprint"]
    return chunk


EXAMPLE_SSE = render(example_items())
INFERD_SSE = render(inferd_items())


# -- evidence bytes ------------------------------------------------------------------------------
def tiny_png(width: int = 4, height: int = 4) -> bytes:
    """A valid RGB PNG of a small gradient."""
    rows = b"".join(
        b"\x00" + bytes(v for x in range(width) for v in (x * 40 % 256, y * 40 % 256, 128))
        for y in range(height)
    )
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", zlib.compress(rows, 9))
        + _png_chunk(b"IEND", b"")
    )


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def tiny_wav(rate: int = 8000, millis: int = 50) -> bytes:
    """A valid 16-bit mono PCM WAV of a 440 Hz tone."""
    n = rate * millis // 1000
    samples = b"".join(
        struct.pack("<h", int(8000 * math.sin(2 * math.pi * 440 * i / rate))) for i in range(n)
    )
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", len(samples)) + samples
    return b"RIFF" + struct.pack("<I", len(body)) + body


def tiny_mp4() -> bytes:
    """An ISO-BMFF container stub: an ftyp box and an empty free box.

    Enough for format sniffing and staging; the example never decodes video, so no tracks.
    """
    ftyp = b"isom" + struct.pack(">I", 512) + b"isomiso2mp41"
    return _box(b"ftyp", ftyp) + _box(b"free", b"")


def _box(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", 8 + len(payload)) + kind + payload
