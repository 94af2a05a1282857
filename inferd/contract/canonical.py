"""Canonical JSON and the digest and identifier checks every contract module shares.

Canonical JSON here means: keys sorted, no insignificant whitespace, UTF-8 without escaping,
and no NaN or infinity. Lists keep their order, because order is meaning (content parts,
artifact digests); only object keys are sorted.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

# The integration release every receipt names, bumped whenever a validator or a rendering
# rule changes, so that old receipts stay attributable to the rules that produced them.
INTEGRATION_RELEASE = "inferd.contract/0.3.0"

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# The server's own rule for x-request-id, reused for every caller-chosen identifier that
# travels in a header or a file name.
_TOKEN = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def canonical_json(value: Any) -> bytes:
    """The one byte form of ``value`` that digests are computed over."""
    text = json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )
    return text.encode("utf-8")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digest_of(value: Any) -> str:
    """sha256 of the canonical JSON of ``value``."""
    return sha256_hex(canonical_json(value))


def is_sha256(value: object) -> bool:
    """A lowercase 64-hex digest; uppercase is refused so one digest has one spelling."""
    return isinstance(value, str) and _SHA256.fullmatch(value) is not None


def is_token(value: object) -> bool:
    """1-128 characters of letters, digits, '.', '_', ':' or '-'."""
    return isinstance(value, str) and _TOKEN.fullmatch(value) is not None
