"""The isolated fetcher for remote media (only used with --allow-remote-media).

Every hop, the first request and each redirect, goes through the same checks before a byte is
sent: scheme http/https, a port from the allowed list, no credentials in the URL, a host whose
addresses are all public. DNS is resolved once per hop and the connection goes to the resolved
address (TLS still verifies the certificate against the host name), so a name cannot resolve
one way for the check and another for the connect. Redirects are followed by hand, at most
``max_redirects`` of them. Bytes and wall time are capped while the body streams in. Anything
refused raises ``FetchError`` with a reason fit to show the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import ssl
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit

import h11

from inferd.net import IPAddress, IPNetwork, address_refusal, ip_literal, looks_numeric
from inferd.net import resolve as net_resolve
from inferd.server.defaults import DEFAULT_REMOTE_MEDIA_PORTS
from inferd.version import __version__

DEFAULT_PORTS = DEFAULT_REMOTE_MEDIA_PORTS
MAX_URL_CHARS = 8192
MAX_RESPONSE_HEADER_BYTES = 16384
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})


class FetchError(ValueError):
    """A remote media URL refused or failed; the message says why."""


@dataclass(frozen=True, slots=True)
class FetchPolicy:
    max_bytes: int
    timeout: float = 10.0
    max_redirects: int = 3
    allowed_ports: frozenset[int] = DEFAULT_PORTS
    allow_networks: tuple[IPNetwork, ...] = ()
    user_agent: str = f"inferd/{__version__} (media fetcher)"


@dataclass(frozen=True, slots=True)
class Target:
    url: str
    scheme: str
    host: str  # as in the URL, lower-case, no brackets
    port: int
    target: str  # path and query for the request line
    literal: IPAddress | None = None


@dataclass(slots=True)
class Fetched:
    data: bytes
    content_type: str | None
    url: str  # after redirects
    redirects: int = 0
    peers: list[str] = field(default_factory=list)  # addresses connected to, per hop


def check_remote_url(
    url: str, allowed_ports: Iterable[int], allow_networks: Iterable[IPNetwork] = ()
) -> Target:
    """Static checks of an http(s) URL (no DNS, no traffic); raises FetchError."""
    if len(url) > MAX_URL_CHARS:
        raise FetchError(f"the URL is longer than {MAX_URL_CHARS} characters")
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in url):
        raise FetchError("the URL contains whitespace or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise FetchError(f"the URL is malformed: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise FetchError(f"the URL scheme {scheme[:16]!r} is not allowed for remote media")
    if parts.username is not None or parts.password is not None:
        raise FetchError("remote media URLs must not carry credentials")
    host = (parts.hostname or "").lower()
    if not host:
        raise FetchError("the URL has no host")
    if port is None:
        port = 443 if scheme == "https" else 80
    ports = sorted(set(allowed_ports))
    if port not in ports:
        allowed = ", ".join(str(p) for p in ports)
        raise FetchError(f"port {port} is not allowed for remote media (allowed: {allowed})")
    literal = ip_literal(host)
    if literal is not None:
        reason = address_refusal(literal, allow_networks)
        if reason is not None:
            raise FetchError(f"the host is a {reason} address, which remote media may not use")
    else:
        _check_host_name(host)
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return Target(url, scheme, host, port, target, literal)


def _check_host_name(host: str) -> None:
    if len(host) > 253:
        raise FetchError("the host name is too long")
    try:
        host.encode("idna")
    except UnicodeError:
        raise FetchError("the host name is not a valid domain name") from None
    if looks_numeric(host):
        raise FetchError("the host is written as a number; use a dotted IP address")


async def resolve(target: Target, allow_networks: Iterable[IPNetwork] = ()) -> list[IPAddress]:
    """Resolve once; every address must be allowed (mixed answers are refused)."""
    if target.literal is not None:
        return [target.literal]
    try:
        addresses = await net_resolve(target.host, target.port)
    except (socket.gaierror, UnicodeError) as exc:
        raise FetchError(f"the host {target.host!r} could not be resolved ({exc})") from None
    if not addresses:
        raise FetchError(f"the host {target.host!r} has no addresses")
    networks = list(allow_networks)
    for ip in addresses:
        reason = address_refusal(ip, networks)
        if reason is not None:
            raise FetchError(
                f"the host {target.host!r} resolves to a {reason} address, "
                "which remote media may not use"
            )
    return addresses


async def fetch(
    url: str, policy: FetchPolicy, *, ssl_context: ssl.SSLContext | None = None
) -> Fetched:
    """GET ``url`` under ``policy``; raises FetchError with the reason for any refusal."""
    try:
        async with asyncio.timeout(policy.timeout):
            return await _fetch(url, policy, ssl_context)
    except TimeoutError:
        raise FetchError(f"fetching the media took longer than {policy.timeout:g}s") from None


async def _fetch(url: str, policy: FetchPolicy, ssl_context: ssl.SSLContext | None) -> Fetched:
    redirects = 0
    peers: list[str] = []
    while True:
        target = check_remote_url(url, policy.allowed_ports, policy.allow_networks)
        addresses = await resolve(target, policy.allow_networks)
        status, location, content_type, data, peer = await _get(
            target, addresses, policy, ssl_context
        )
        peers.append(peer)
        if status in REDIRECT_STATUSES:
            if location is None:
                raise FetchError(f"the media server answered HTTP {status} without a Location")
            redirects += 1
            if redirects > policy.max_redirects:
                raise FetchError(f"the media URL redirected more than {policy.max_redirects} times")
            url = urljoin(url, location)
            continue
        if status != 200:
            raise FetchError(f"the media server answered HTTP {status}")
        return Fetched(data, content_type, url, redirects, peers)


async def _get(
    target: Target,
    addresses: list[IPAddress],
    policy: FetchPolicy,
    ssl_context: ssl.SSLContext | None,
) -> tuple[int, str | None, str | None, bytes, str]:
    reader, writer, peer = await _connect(target, addresses, ssl_context)
    try:
        conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_RESPONSE_HEADER_BYTES)
        host_header = target.host if ":" not in target.host else f"[{target.host}]"
        default = 443 if target.scheme == "https" else 80
        if target.port != default:
            host_header += f":{target.port}"
        request = h11.Request(
            method="GET",
            target=target.target.encode("ascii", "strict"),
            headers=[
                ("Host", host_header),
                ("User-Agent", policy.user_agent),
                ("Accept", "*/*"),
                ("Accept-Encoding", "identity"),
                ("Connection", "close"),
            ],
        )
        writer.write(conn.send(request) + (conn.send(h11.EndOfMessage()) or b""))
        await writer.drain()
        response = await _next_event(conn, reader)
        if not isinstance(response, h11.Response):
            raise FetchError("the media server sent no HTTP response")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in response.headers}
        if response.status_code in REDIRECT_STATUSES:
            return response.status_code, headers.get("location"), None, b"", peer
        if response.status_code != 200:
            return response.status_code, None, None, b"", peer
        encoding = headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise FetchError(f"the media server sent a {encoding!r}-encoded body; identity only")
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > policy.max_bytes:
            raise FetchError(
                f"the media is {int(declared)} bytes, over the {policy.max_bytes}-byte limit"
            )
        body = bytearray()
        while True:
            event = await _next_event(conn, reader)
            if isinstance(event, h11.Data):
                body += event.data
                if len(body) > policy.max_bytes:
                    raise FetchError(f"the media is over the {policy.max_bytes}-byte limit")
            elif isinstance(event, h11.EndOfMessage):
                return 200, None, headers.get("content-type"), bytes(body), peer
            else:
                raise FetchError("the media server closed the connection mid-body")
    except FetchError:
        raise
    except h11.ProtocolError as exc:
        raise FetchError(f"the media server broke the HTTP protocol: {exc}") from None
    except (UnicodeError, ValueError) as exc:
        raise FetchError(f"the media URL cannot be requested: {exc}") from None
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):
                await writer.wait_closed()


async def _connect(
    target: Target, addresses: list[IPAddress], ssl_context: ssl.SSLContext | None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str]:
    tls: ssl.SSLContext | None = None
    if target.scheme == "https":
        tls = ssl_context or ssl.create_default_context()
    errors = []
    for ip in addresses:
        try:
            reader, writer = await asyncio.open_connection(
                str(ip),
                target.port,
                ssl=tls,
                server_hostname=target.host if tls is not None else None,
            )
        except (OSError, ssl.SSLError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        peer = writer.get_extra_info("peername")
        if not peer or ipaddress.ip_address(str(peer[0]).split("%", 1)[0]) != ip:
            writer.close()
            raise FetchError("the connection did not reach the resolved address")
        return reader, writer, str(ip)
    raise FetchError(f"could not connect to the media server: {'; '.join(errors)[:300]}")


async def _next_event(conn: h11.Connection, reader: asyncio.StreamReader) -> object:
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await reader.read(65536))
            continue
        return event
