"""Defaults of the operational settings, importable without the web stack (the CLI parser)."""

from __future__ import annotations

# What one decoded item may hold; the media layer owns them (inferd/media/limits.py says why).
from inferd.media.limits import (
    DEFAULT_MAX_AUDIO_SAMPLE_RATE,
    DEFAULT_MAX_AUDIO_SECONDS,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_VIDEO_FRAMES,
    DEFAULT_MAX_VIDEO_SECONDS,
)

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_HEADER_BYTES = 16 * 1024
DEFAULT_MAX_MEDIA_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_NUM_IMAGES = 8
# Decoded image pixels held at once across requests (server/media_budget.py): 144 megapixels,
# four of the largest images --max-image-pixels lets through, about 430 MB as RGB.
DEFAULT_MAX_DECODED_PIXELS = 144_000_000
DEFAULT_MAX_NUM_AUDIOS = 4
DEFAULT_MAX_NUM_VIDEOS = 2
DEFAULT_MEDIA_FETCH_TIMEOUT = 10.0
DEFAULT_REMOTE_MEDIA_PORTS = frozenset({80, 443})
ACCESS_LOG_FORMATS = ("text", "json")
API_KEYS_ENV = "INFERD_API_KEYS"
ADMIN_KEYS_ENV = "INFERD_ADMIN_KEYS"
DEFAULT_HEADER_TIMEOUT = 20.0  # seconds for a whole request head
DEFAULT_BODY_TIMEOUT = 30.0  # seconds for a body, plus a second per 32 KiB received
DEFAULT_MAX_CONNECTIONS = 512
# (token, logprob) pairs one completions response may carry: a full 8,192-token echo with 20
# top logprobs is 172k; `echo` + `logprobs: 20` + `n: 16` on a 4,000-token prompt is 1.3M.
DEFAULT_MAX_LOGPROBS_TOKENS = 262_144
# /v1/files: one file is one upload body; all of them together
DEFAULT_MAX_FILE_BYTES = DEFAULT_MAX_BODY_BYTES
DEFAULT_MAX_FILES_TOTAL_BYTES = 1 << 30
DEFAULT_RESPONSES_TTL = 30 * 24 * 3600.0  # seconds a stored response lives (as OpenAI keeps them)

__all__ = [
    "DEFAULT_MAX_AUDIO_SAMPLE_RATE",
    "DEFAULT_MAX_AUDIO_SECONDS",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "DEFAULT_MAX_VIDEO_FRAMES",
    "DEFAULT_MAX_VIDEO_SECONDS",
]
