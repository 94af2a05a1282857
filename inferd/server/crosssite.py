"""What keeps a web page in the user's browser from driving a server that has no API key.

A page on any site may send "simple" requests to ``http://127.0.0.1:1234`` without a CORS
preflight: a POST whose content type is ``text/plain``, a form encoding or none. And through DNS
rebinding (``evil.example`` first resolves to the attacker, then to 127.0.0.1) the page can also
read the answers, since the browser then sees the server as same-origin. Two checks close both:

- JSON routes take only ``Content-Type: application/json`` (parameters such as charset allowed):
  anything else is a 415 before the body is read. A browser sends that content type
  cross-origin only after a preflight, which fails unless ``--allowed-origins`` names the page.
- The ``Host`` header must name this server: by default the loopback names and the bound
  address, with the port. A rebound page sends its own name (``Host: evil.example:1234``) and
  gets a 421 before routing. An IP-literal Host cannot be rebound (the page's origin *is* that
  address), so on a wildcard bind (0.0.0.0, ::), whose addresses are not known up front, any IP
  literal on the port is accepted too.

``build_app`` leaves the Host check off unless given ``allowed_hosts``: an app mounted in another
one (or driven by an in-process test client, Host ``testserver``) is reached under names only
its embedder knows. ``inferd serve`` always passes the list. Under ``--ray`` the ingress checks
it and the replicas' apps, reached only through Serve handle calls from the ingress, do not.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from inferd.server.envelope import error_response, header

Handler = Callable[[Request], Awaitable[Response]]

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
ANY_HOST = "*"
_WILDCARD_BINDS = ("0.0.0.0", "::", "")
_SHOWN = 100  # characters of a refused value quoted back


# -- content type -------------------------------------------------------------------------------
def is_json(content_type: str | None) -> bool:
    """``application/json``, with or without parameters (``; charset=utf-8``)."""
    if content_type is None:
        return False
    return content_type.split(";", 1)[0].strip().lower() == "application/json"


def json_only(handler: Handler) -> Handler:
    """Wrap a JSON route: any other content type gets 415 before the body is read."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        content_type = header(request.scope, b"content-type")
        if not is_json(content_type):
            got = "none" if content_type is None else repr(content_type[:_SHOWN])
            return error_response(
                request.scope,
                415,
                f"this route takes a JSON body: send 'Content-Type: application/json' (got {got})",
                code="unsupported_media_type",
            )
        return await handler(request)

    return wrapped


# -- Host allow-list ----------------------------------------------------------------------------
def is_loopback(host: str) -> bool:
    """Whether a bind address (or name) reaches this machine only."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class HostAllowList:
    """Which ``Host`` headers a server answers.

    ``names``: lower-case host names (IPv6 in brackets), each either with a port (``name:1234``,
    only that port) or without (any port). ``port``: the server's port, which a Host without
    one means 80 against. ``ip_literals``: also accept any IP address on ``port``.
    """

    names: frozenset[str]
    port: int | None = None
    ip_literals: bool = False

    @classmethod
    def for_server(cls, bind_host: str, port: int, extra: Iterable[str] = ()) -> HostAllowList:
        """The loopback names and the bound address on ``port``, plus ``extra`` (any port
        unless an entry names one); ``*`` among ``extra`` turns the check off."""
        bound = _bracketed(bind_host)
        own = {f"{name}:{port}" for name in (*LOOPBACK_NAMES, bound) if name}
        added = {_normal(e) for e in validate_hosts(list(extra))}
        return cls(frozenset(own | added), port, bind_host in _WILDCARD_BINDS)

    @classmethod
    def of(cls, names: Iterable[str]) -> HostAllowList:
        """Exactly ``names`` (``name`` for any port, ``name:port`` for one; ``*``: any Host)."""
        return cls(frozenset(_normal(n) for n in validate_hosts(list(names))))

    @property
    def allows_any(self) -> bool:
        return ANY_HOST in self.names

    def allows(self, host: str | None) -> bool:
        if self.allows_any:
            return True
        if host is None:
            return False  # HTTP/1.1 requires Host; a browser always sends one
        value = _normal(host)
        name, port = _split(value)
        if port is None:
            port = 80
        if name in self.names or f"{name}:{port}" in self.names:
            return True
        return self.ip_literals and port == self.port and _is_ip(name)

    def describe(self) -> str:
        if self.allows_any:
            return "any (--allowed-hosts '*': DNS rebinding is not stopped)"
        shown = ", ".join(sorted(self.names))
        return shown + (f", any IP address:{self.port}" if self.ip_literals else "")


def validate_hosts(hosts: Sequence[str]) -> tuple[str, ...]:
    out = []
    for entry in hosts:
        value = entry.strip()
        if not value:
            continue
        if value != ANY_HOST and ("/" in value or "@" in value or " " in value):
            raise ValueError(f"allowed host {value!r} must be a host name, optionally with :port")
        out.append(value)
    return tuple(out)


class HostMiddleware:
    """421 in the caller's envelope for a ``Host`` the allow-list does not hold."""

    def __init__(self, app: ASGIApp, *, allowed: HostAllowList) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = host_refusal(scope, self.allowed) if scope["type"] == "http" else None
        if refusal is None:
            await self.app(scope, receive, send)
        else:
            await refusal(scope, receive, send)


def host_refusal(scope: Scope, allowed: HostAllowList) -> Response | None:
    """The 421 for a request whose ``Host`` ``allowed`` does not hold, or None to go on (also
    used by the Ray ingress, which checks the client's Host before forwarding)."""
    host = header(scope, b"host")
    if allowed.allows(host):
        return None
    shown = "none" if host is None else repr(host[:_SHOWN])
    message = (
        f"this server does not answer to the Host {shown}; it answers to its own address and "
        "loopback names (start it with --allowed-hosts to add names)"
    )
    return error_response(scope, 421, message, code="host_not_allowed")


def _normal(host: str) -> str:
    return host.strip().lower().rstrip(".")


def _bracketed(host: str) -> str:
    """A bind address as it appears in a Host header (IPv6 in brackets); "" for wildcards."""
    if host in _WILDCARD_BINDS:
        return ""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host.lower()


def _split(value: str) -> tuple[str, int | None]:
    """(name, port) of a Host value; a malformed port is kept in the name, which then fails."""
    if value.startswith("["):
        end = value.find("]")
        name, rest = value[: end + 1], value[end + 1 :]
        if not rest:
            return name, None
        port_text = rest.removeprefix(":")
    else:
        name, sep, port_text = value.rpartition(":")
        if not sep:
            return value, None
    if not port_text.isdigit() or len(port_text) > 5:
        return value, None
    name = name.rstrip(".")
    return name, int(port_text)


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name.strip("[]") if name.startswith("[") else name)
    except ValueError:
        return False
    return not (":" in name and not name.startswith("["))  # bare IPv6 is not a valid Host
