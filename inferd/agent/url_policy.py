"""Which MCP servers a request may name (the Responses API's ``mcp`` tool, ``server_url``).

A request-named server is an outbound connection chosen by the caller, so it is refused unless
the operator allowed it: ``--mcp-allow-url PATTERN`` (repeatable; none by default). A pattern
is ``scheme://host[:port][/path]``: the scheme and port must be equal (the port defaults to
the scheme's), the host equal or, written ``*.example.com``, any name under it, and the path,
when given, a prefix on a ``/`` boundary. After a URL matches, its host is resolved, and an
address that is link-local (169.254.0.0/16, fe80::/10), a cloud metadata endpoint,
unspecified or multicast is refused whatever the patterns say (``inferd/net.py``, the policy
remote media uses too). Loopback and private addresses are reachable only when a pattern names
them, as the operator meant. The connection then goes to the addresses checked here and no
other (agent/pinned.py): the name is not looked up twice, so a DNS answer that changes in
between cannot move it.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from inferd.net import IPAddress, address_refusal, ip_literal, looks_numeric, resolve

MAX_URL_CHARS = 2048
# Address classes no pattern can open: the metadata endpoints live here (169.254.169.254).
NEVER = frozenset({"cloud metadata", "link-local", "unspecified", "multicast"})
_DEFAULT_PORTS = {"http": 80, "https": 443}


class OutboundUrlRefused(ValueError):
    """A request-named URL that may not be reached; the message says why (fit for a 400)."""


@dataclass(frozen=True, slots=True)
class UrlPattern:
    scheme: str
    host: str  # lower-case; "*.example.com" for any name under example.com
    port: int
    path: str  # "" for any path

    @classmethod
    def parse(cls, text: str) -> UrlPattern:
        """ValueError when ``text`` is not ``scheme://host[:port][/path]``."""
        try:
            parts = urlsplit(text)
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"{text!r} is not a URL ({exc})") from None
        scheme = parts.scheme.lower()
        if scheme not in _DEFAULT_PORTS:
            raise ValueError(f"{text!r}: the scheme must be http or https")
        if parts.username is not None or parts.password is not None:
            raise ValueError(f"{text!r}: a pattern carries no credentials")
        if parts.query or parts.fragment:
            raise ValueError(f"{text!r}: a pattern has no query or fragment")
        host = (parts.hostname or "").lower()
        name = host.removeprefix("*.")
        if not name or "*" in name:
            raise ValueError(f"{text!r}: the host must be a name, an address or *.name")
        return cls(scheme, host, port or _DEFAULT_PORTS[scheme], parts.path.rstrip("/"))

    def matches(self, scheme: str, host: str, port: int, path: str) -> bool:
        if scheme != self.scheme or port != self.port:
            return False
        if self.host.startswith("*."):
            if not host.endswith(self.host[1:]):
                return False
        elif host != self.host:
            return False
        return not self.path or path == self.path or path.startswith(self.path + "/")

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.path}"


@dataclass(frozen=True, slots=True)
class CheckedUrl:
    """A URL that passed: where it points and the addresses its host resolved to."""

    url: str
    host: str
    port: int
    addresses: tuple[IPAddress, ...]


@dataclass(frozen=True, slots=True)
class McpUrlPolicy:
    patterns: tuple[UrlPattern, ...] = ()
    # what the messages call the URL (the search backend's --search-url passes too)
    subject: str = "the MCP server_url"

    async def check(self, url: str) -> CheckedUrl:
        """The URL if a request may make inferd connect to it; OutboundUrlRefused says why."""
        _, host, port, _ = self.static_check(url)
        addresses = await _resolve(host, port, self.subject)
        for ip in addresses:
            reason = address_refusal(ip)
            if reason in NEVER:
                raise OutboundUrlRefused(
                    f"{self.subject}'s host resolves to a {reason} address ({ip}), "
                    "which inferd never connects to"
                )
        return CheckedUrl(url, host, port, tuple(addresses))

    def static_check(self, url: str) -> tuple[str, str, int, str]:
        """(scheme, host, port, path) of an allowed URL, before any DNS; OutboundUrlRefused."""
        if len(url) > MAX_URL_CHARS:
            raise OutboundUrlRefused(f"{self.subject} is over {MAX_URL_CHARS} characters")
        if any(ord(c) < 0x21 or ord(c) == 0x7F for c in url):
            raise OutboundUrlRefused(f"{self.subject} contains whitespace or control characters")
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError:
            raise OutboundUrlRefused(f"{self.subject} is not a valid URL") from None
        scheme = parts.scheme.lower()
        if scheme not in _DEFAULT_PORTS:
            raise OutboundUrlRefused(f"{self.subject} must be http or https")
        if parts.username is not None or parts.password is not None:
            raise OutboundUrlRefused(f"{self.subject} must not carry credentials")
        host = (parts.hostname or "").lower().rstrip(".")
        if not host:
            raise OutboundUrlRefused(f"{self.subject} has no host")
        if ip_literal(host) is None and looks_numeric(host):
            raise OutboundUrlRefused(f"{self.subject}'s host is written as a number")
        segments = parts.path.split("/")
        if "." in segments or ".." in segments or "%2e" in parts.path.lower():
            # a pattern's path is a prefix: "/mcp/../admin" must not pass as under "/mcp"
            raise OutboundUrlRefused(f"{self.subject}'s path has dot segments")
        port = port or _DEFAULT_PORTS[scheme]
        if not any(p.matches(scheme, host, port, parts.path) for p in self.patterns):
            if not self.patterns:
                raise OutboundUrlRefused(
                    "request-named MCP servers are off on this server (no --mcp-allow-url)"
                )
            raise OutboundUrlRefused(f"{self.subject} matches no --mcp-allow-url pattern")
        return scheme, host, port, parts.path


async def _resolve(host: str, port: int, subject: str) -> list[IPAddress]:
    try:
        addresses = await resolve(host, port)
    except (socket.gaierror, UnicodeError):
        raise OutboundUrlRefused(f"{subject}'s host {host!r} does not resolve") from None
    if not addresses:
        raise OutboundUrlRefused(f"{subject}'s host {host!r} has no addresses")
    return addresses
