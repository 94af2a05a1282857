"""What an outbound connection may reach: the address policy shared by every fetcher that goes
where a request (or a model) points it (remote media, request-named MCP servers).

Arithmetic on addresses: ``address_refusal`` names the class of an address that may not be
reached ("loopback", "cloud metadata", ...). An IPv6 address that carries an
IPv4 one (mapped, 6to4, Teredo, NAT64) is judged by the IPv4 address too, so a refused target
cannot be reached through a translation prefix. ``resolve`` is the one DNS lookup both
fetchers make before judging the addresses.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Cloud instance-metadata and host-agent endpoints: refused even inside allow_networks.
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a)
    for a in (
        "169.254.169.254",  # AWS, GCP, Azure, OpenStack, DigitalOcean, ...
        "169.254.170.2",  # AWS ECS task metadata
        "169.254.169.253",  # AWS DNS
        "100.100.100.200",  # Alibaba Cloud
        "168.63.129.16",  # Azure wire server
        "fd00:ec2::254",  # AWS IPv6 metadata
        "fd00:ec2::23",  # AWS IPv6 DNS
    )
)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def embedded_ipv4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (mapped, 6to4, Teredo, NAT64), if any."""
    if isinstance(ip, ipaddress.IPv4Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def address_refusal(ip: IPAddress | str, allow_networks: Iterable[IPNetwork] = ()) -> str | None:
    """Why a public-only fetcher may not reach ``ip`` ("loopback", "private", ...), or None.

    ``allow_networks`` lets an operator reach chosen non-public networks (an internal media
    store); metadata addresses stay refused regardless.
    """
    if isinstance(ip, str):
        ip = ipaddress.ip_address(ip)
    inner = embedded_ipv4(ip)
    if inner is not None:
        reason = address_refusal(inner, allow_networks)
        if reason is not None:
            return reason
    if ip in METADATA_ADDRESSES:
        return "cloud metadata"
    if any(ip.version == net.version and ip in net for net in allow_networks):
        return None
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if ip.is_multicast:
        return "multicast"
    if isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local:
        return "site-local"
    if ip.is_private:
        return "private"
    if ip.is_reserved:
        return "reserved"
    if not ip.is_global:
        return "non-public"
    return None


def looks_numeric(host: str) -> bool:
    """Hosts like 2130706433, 0x7f.1 or 017.0.0.1 that resolvers may read as IPv4 addresses."""
    labels = host.rstrip(".").split(".")
    return all(label and all(c in "0123456789abcdefx" for c in label) for label in labels) and any(
        label[0].isdigit() for label in labels
    )


def ip_literal(host: str) -> IPAddress | None:
    """``host`` as an address when it is one written out (not a name to resolve)."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


async def resolve(host: str, port: int) -> list[IPAddress]:
    """The TCP addresses of ``host`` (a literal is its own), each once, in the resolver's
    order; [] when it has none. ``socket.gaierror`` or ``UnicodeError`` when it does not
    resolve: the caller says so in its own terms."""
    literal = ip_literal(host)
    if literal is not None:
        return [literal]
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    addresses: list[IPAddress] = []
    for info in infos:
        ip = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])  # no IPv6 zone id
        if ip not in addresses:
            addresses.append(ip)
    return addresses
