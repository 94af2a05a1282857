"""Signatures of Anthropic ``thinking`` blocks: proof that a block sent back came from here.

Anthropic's clients send an assistant turn's thinking blocks back in the next request (tool
loops must); the ``signature`` lets the server tell its own thinking from text a client wrote
or altered. Here it is an HMAC-SHA256 of the model id and the thinking text under a key drawn
at random when the server process starts: a block signed by this server verifies, an edited
one (or one signed by another server, or before a restart) does not, and is refused with a
400. The key never leaves the process, so a signature reveals nothing but equality.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

_KEY = secrets.token_bytes(32)  # per server process: signatures do not outlive it


def sign(model_id: str, thinking: str) -> str:
    mac = hmac.new(_KEY, f"{model_id}\0{thinking}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).decode().rstrip("=")


def verify(model_id: str, thinking: str, signature: object) -> bool:
    """Whether ``signature`` is this server's for ``thinking`` from ``model_id``."""
    if not isinstance(signature, str) or not signature:
        return False
    return hmac.compare_digest(sign(model_id, thinking), signature)
