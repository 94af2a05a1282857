"""API-key authentication as ASGI middleware (--api-key, INFERD_API_KEYS).

A request is let through when ``Authorization: Bearer <key>`` or ``x-api-key: <key>`` holds one
of the configured keys. Keys are compared as SHA-256 digests with ``hmac.compare_digest``,
against every key without stopping early, so timing reveals neither a key's length nor which
key came close. ``/health`` stays open. Refusals are 401 in the caller's envelope.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable, Mapping, Sequence

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from inferd.server.defaults import API_KEYS_ENV
from inferd.server.envelope import app_path, error_response, header

ENV_VAR = API_KEYS_ENV
OPEN_PATHS = frozenset({"/health", "/ready"})  # probes of orchestrators carry no keys


def keys_from_env(environ: Mapping[str, str], var: str = ENV_VAR) -> list[str]:
    """Comma-separated keys; blank entries are skipped, but only blanks is an error."""
    raw = environ.get(var)
    if raw is None or not raw.strip():
        return []
    keys = [k.strip() for k in raw.split(",") if k.strip()]
    if not keys:
        raise ValueError(f"{var} is set but holds no keys")
    return keys


def validate_keys(keys: Iterable[str]) -> tuple[str, ...]:
    out = []
    for key in keys:
        if not key or key != key.strip():
            raise ValueError("an API key must be non-empty with no surrounding whitespace")
        if any(ord(c) < 0x21 or ord(c) > 0x7E for c in key):
            raise ValueError("an API key must be printable ASCII without spaces")
        out.append(key)
    return tuple(dict.fromkeys(out))


def _digest(value: str | bytes) -> bytes:
    data = value.encode("latin-1", "replace") if isinstance(value, str) else value
    return hashlib.sha256(data).digest()


class AuthMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        api_keys: Sequence[str],
        open_paths: Iterable[str] = OPEN_PATHS,
        key_name: str = "API key",
        open_when: Callable[[Scope], bool] | None = None,
    ) -> None:
        keys = validate_keys(api_keys)
        if not keys:
            raise ValueError("AuthMiddleware needs at least one API key")
        self.app = app
        self._digests = tuple(_digest(k) for k in keys)
        self.open_paths = frozenset(open_paths)
        self.key_name = key_name
        self.open_when = open_when  # requests another guard checks (admin actions)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or app_path(scope) in self.open_paths:
            await self.app(scope, receive, send)
            return
        if self.open_when is not None and self.open_when(scope):
            await self.app(scope, receive, send)
            return
        offered = _offered_keys(scope)
        if not offered:
            message = (
                f"this server requires {_article(self.key_name)} {self.key_name}: send it as "
                "'Authorization: Bearer <key>' or 'x-api-key: <key>'"
            )
            await self._refuse(scope, receive, send, message)
            return
        if not self._any_valid(offered):
            message = f"the {self.key_name} is not valid for this server"
            await self._refuse(scope, receive, send, message)
            return
        await self.app(scope, receive, send)

    def _any_valid(self, offered: list[str]) -> bool:
        ok = 0
        for candidate in offered:
            got = _digest(candidate)
            for want in self._digests:
                ok |= hmac.compare_digest(got, want)
        return bool(ok)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, message: str) -> None:
        response = error_response(
            scope, 401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
        )
        await response(scope, receive, send)


def _article(noun: str) -> str:
    return "an" if noun[0].lower() in "aeiou" else "a"


def _offered_keys(scope: Scope) -> list[str]:
    offered = []
    authorization = header(scope, b"authorization")
    if authorization is not None:
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            offered.append(token.strip())
    api_key = header(scope, b"x-api-key")
    if api_key is not None and api_key.strip():
        offered.append(api_key.strip())
    return offered


def request_owner(request: Request) -> str | None:
    """Who owns what a request stores or waits on (``key_owner`` under the server's keys)."""
    return key_owner(request.scope, request.app.state.inferd.options.api_keys)


def key_owner(scope: Scope, keys: Sequence[str]) -> str | None:
    """The SHA-256 (hex) of the configured key a request came in with: who owns what it stores
    (stored responses), without keeping the key itself. None when the server takes no keys."""
    if not keys:
        return None
    digests = {_digest(k) for k in keys}
    for offered in _offered_keys(scope):
        digest = _digest(offered)
        if digest in digests:
            return digest.hex()
    return None
