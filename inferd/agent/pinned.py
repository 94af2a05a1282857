"""An HTTP client that reaches one host only at the addresses already checked for it.

A request-named MCP server's URL is checked by resolving its host (agent/url_policy.py); if the
connection resolved the name again, a DNS answer changed in between (rebinding: a public
address for the check, 169.254.169.254 for the connection) would reach what the check refused.
So the client made here never resolves: its network backend connects the checked host's name
to the checked addresses (in order, the first that answers), refuses any other host, and the
client takes no proxy from the environment. TLS still verifies the certificate against the
host's name (the connection pool starts TLS with it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import httpcore2
import httpx2

from inferd.net import IPAddress


class PinnedBackend(httpcore2.AsyncNetworkBackend):
    """Connects ``host`` to ``addresses`` only."""

    def __init__(self, host: str, addresses: Sequence[IPAddress]) -> None:
        if not addresses:
            raise ValueError("a pinned host needs at least one address")
        self.host = host.lower().rstrip(".")
        self.addresses = tuple(addresses)
        self._inner = httpcore2.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore2.AsyncNetworkStream:
        if host.lower().rstrip(".") != self.host:
            raise httpcore2.ConnectError(f"this connection may reach {self.host} only, not {host}")
        failure: Exception | None = None
        for ip in self.addresses:
            try:
                return await self._inner.connect_tcp(
                    str(ip), port, timeout, local_address, socket_options
                )
            except (httpcore2.ConnectError, httpcore2.ConnectTimeout) as exc:
                failure = exc
        assert failure is not None
        raise failure

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore2.AsyncNetworkStream:
        raise httpcore2.ConnectError("a pinned connection takes no unix socket")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


def pinned_client(
    host: str,
    addresses: Sequence[IPAddress],
    headers: Mapping[str, str],
    timeout: httpx2.Timeout,
) -> httpx2.AsyncClient:
    """An httpx2 client (the MCP SDK's) whose connections go to ``addresses`` only."""
    transport = httpx2.AsyncHTTPTransport(trust_env=False)
    # httpx2's transport takes no network backend: its connection pool does, so the transport's
    # pool is replaced by one built the same way (TLS context, no proxy) with the pinned backend.
    transport._pool = httpcore2.AsyncConnectionPool(
        ssl_context=httpx2.create_ssl_context(trust_env=False),
        network_backend=PinnedBackend(host, addresses),
    )
    return httpx2.AsyncClient(
        transport=transport, headers=dict(headers), timeout=timeout, trust_env=False
    )
