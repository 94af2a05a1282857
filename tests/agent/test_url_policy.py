"""Request-named MCP servers (the Responses `mcp` tool's server_url): off unless a
--mcp-allow-url pattern matches, and never link-local or metadata addresses."""

from __future__ import annotations

import asyncio
import ipaddress

import pytest

from inferd.agent.url_policy import CheckedUrl, McpUrlPolicy, OutboundUrlRefused, UrlPattern


def policy(*patterns: str) -> McpUrlPolicy:
    return McpUrlPolicy(tuple(UrlPattern.parse(p) for p in patterns))


def check(p: McpUrlPolicy, url: str) -> CheckedUrl:
    return asyncio.run(p.check(url))


def test_nothing_is_allowed_by_default() -> None:
    with pytest.raises(OutboundUrlRefused, match="off on this server"):
        check(policy(), "https://mcp.example.com/mcp")


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data/",
        "http://[::ffff:169.254.169.254]/",
        "http://169.254.10.1/mcp",
        "http://[fe80::1]/mcp",
    ],
)
def test_metadata_and_link_local_addresses_are_refused_even_when_a_pattern_names_them(
    url: str,
) -> None:
    p = policy(
        "http://169.254.169.254",
        "http://[::ffff:169.254.169.254]",
        "http://169.254.10.1",
        "http://[fe80::1]",
    )
    with pytest.raises(OutboundUrlRefused, match=r"(link-local|cloud metadata) address"):
        check(p, url)


def test_a_loopback_port_not_allowed_is_refused_and_the_allowed_one_passes() -> None:
    p = policy("http://127.0.0.1:9000/mcp")
    with pytest.raises(OutboundUrlRefused, match="matches no --mcp-allow-url"):
        check(p, "http://127.0.0.1:9001/mcp")
    with pytest.raises(OutboundUrlRefused, match="matches no --mcp-allow-url"):
        check(p, "http://127.0.0.1/mcp")
    ok = check(p, "http://127.0.0.1:9000/mcp")
    assert ok.addresses == (ipaddress.ip_address("127.0.0.1"),) and ok.port == 9000


def test_an_allowed_name_is_resolved_and_its_addresses_returned() -> None:
    ok = check(policy("http://localhost:8123"), "http://localhost:8123/anything")
    assert ok.host == "localhost" and all(ip.is_loopback for ip in ok.addresses)


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("https://tools.example.com/mcp", True),
        ("https://tools.example.com/mcp/sub", True),
        ("https://tools.example.com/mcpx", False),  # a prefix on a "/" boundary only
        ("https://tools.example.com/", False),
        ("http://tools.example.com/mcp", False),  # scheme
        ("https://tools.example.com:8443/mcp", False),  # port
        ("https://a.b.example.com/mcp", True),  # *.example.com
        ("https://example.com/mcp", False),
        ("https://example.com.evil.net/mcp", False),
        ("https://tools.example.com/mcp/../admin", False),  # dot segments
        ("https://user:pw@tools.example.com/mcp", False),
    ],
)
def test_patterns_match_scheme_host_port_and_path_prefix(url: str, allowed: bool) -> None:
    p = policy("https://*.example.com/mcp")
    if allowed:
        assert p.static_check(url)[1].endswith(".example.com")
    else:
        with pytest.raises(OutboundUrlRefused):
            p.static_check(url)


@pytest.mark.parametrize(
    "pattern", ["ftp://x.com", "https://", "https://a.*.com", "https://x.com/?q=1", "https://u@x"]
)
def test_bad_patterns_are_refused(pattern: str) -> None:
    with pytest.raises(ValueError):
        UrlPattern.parse(pattern)


def test_numeric_host_spellings_are_refused() -> None:
    with pytest.raises(OutboundUrlRefused, match="written as a number"):
        policy("http://2852039166").static_check("http://2852039166/")
