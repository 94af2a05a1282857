"""Operational settings in-process (no model needed): switches, validation, the metrics format."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest

from inferd.cli import _parser, main
from inferd.server.app import build_app
from inferd.server.auth import keys_from_env
from inferd.server.metrics import Counter, Gauge, Histogram, Registry, format_value
from inferd.server.options import ServerOptions
from inferd.server.serve_args import server_options


def _get(app: object, *paths: str) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [await client.get(p) for p in paths]

    return asyncio.run(run())


def test_metrics_and_docs_can_be_switched_off() -> None:
    on = _get(build_app([]), "/metrics", "/docs", "/openapi.json")
    assert [r.status_code for r in on] == [200, 200, 200]
    options = ServerOptions(metrics=False, docs=False)
    off = _get(build_app([], options), "/metrics", "/docs", "/openapi.json")
    assert [r.status_code for r in off] == [404, 404, 404]
    assert off[0].json()["error"]["message"] == "no route GET /metrics"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"access_log_format": "xml"}, "access log format must be one of text, json"),
        ({"allowed_origins": ("app.example",)}, "must be http(s)://host[:port]"),
        ({"allowed_origins": "https://app.example"}, "not one string"),
        ({"api_keys": ("",)}, "must be non-empty"),
        ({"api_keys": ("two words",)}, "printable ASCII without spaces"),
        ({"api_keys": (" padded",)}, "no surrounding whitespace"),
        ({"max_body_bytes": 0}, "--max-body-bytes must be at least 1"),
        ({"request_timeout": 0.0}, "--request-timeout must be positive"),
        ({"drain_timeout": -1.0}, "--drain-timeout must not be negative"),
        ({"keepalive_seconds": 0.0}, "keepalive_seconds must be positive"),
    ],
)
def test_server_options_refuse_unsafe_settings(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        ServerOptions(**kwargs)  # type: ignore[arg-type]


def test_server_options_from_the_serve_flags() -> None:
    parser = _parser()
    args = parser.parse_args(
        [
            *(
                "serve",
                "--api-key",
                "k1",
                "--allowed-origins",
                "https://a.example,https://b.example",
            ),
            *("--request-timeout", "30", "--access-log-format", "off", "--no-docs"),
            *("--default-model-id", "chat", "--auto-reload", "off", "--log-payloads", "p.jsonl"),
        ]
    )
    options = server_options(args, {"INFERD_API_KEYS": "k2,k1"})
    assert options == ServerOptions(
        default_model="chat",
        auto_reload=False,
        api_keys=("k1", "k2"),
        allowed_origins=("https://a.example", "https://b.example"),
        request_timeout=30.0,
        access_log_format=None,
        log_payloads=Path("p.jsonl"),
        docs=False,
        media_policy=options.media_policy,
    )
    assert server_options(parser.parse_args(["serve"]), {}) == ServerOptions()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--api-key", ""], "an API key must be non-empty"),
        (["--allowed-media-root", "/nonexistent/media"], "not an existing directory"),
        (["--request-timeout", "0"], "--request-timeout must be positive"),
        (["--max-body-bytes", "0"], "--max-body-bytes must be at least 1"),
        (["--max-header-bytes", "100"], "--max-header-bytes must be at least 1024"),
        (["--remote-media-ports", "80,http"], "--remote-media-ports must be comma-separated"),
        (["--remote-media-ports", "0"], "ports must be between 1 and 65535"),
        (["--allowed-origins", "nope"], "must be http(s)://host[:port]"),
    ],
)
def test_serve_flags_are_checked_before_the_model_loads(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing_model = str(tmp_path / "never-loaded.gguf")
    assert main(["serve", "-m", missing_model, *flags]) == 2
    assert message in capsys.readouterr().err


def test_api_keys_from_the_environment() -> None:
    assert keys_from_env({}) == []
    assert keys_from_env({"INFERD_API_KEYS": ""}) == []
    assert keys_from_env({"INFERD_API_KEYS": " a, b ,,c "}) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="holds no keys"):
        keys_from_env({"INFERD_API_KEYS": " , ,"})


def test_the_exposition_format() -> None:
    registry = Registry()
    c = registry.add(Counter("t_requests_total", "Requests.", ["route"]))
    g = registry.add(Gauge("t_in_flight", "In flight."))
    h = registry.add(Histogram("t_seconds", "Latency.", ["model"], [0.1, 1]))
    c.inc(2, ['/v1/"x"\\\n'])
    g.inc()
    g.dec(3)
    h.observe(0.05, ["m"])
    h.observe(0.5, ["m"], count=2)
    h.observe(7, ["m"])
    assert registry.render() == [
        "# HELP t_requests_total Requests.",
        "# TYPE t_requests_total counter",
        't_requests_total{route="/v1/\\"x\\"\\\\\\n"} 2',
        "# HELP t_in_flight In flight.",
        "# TYPE t_in_flight gauge",
        "t_in_flight -2",
        "# HELP t_seconds Latency.",
        "# TYPE t_seconds histogram",
        't_seconds_bucket{model="m",le="0.1"} 1',
        't_seconds_bucket{model="m",le="1"} 3',
        't_seconds_bucket{model="m",le="+Inf"} 4',
        't_seconds_sum{model="m"} 8.05',
        't_seconds_count{model="m"} 4',
    ]
    with pytest.raises(ValueError, match="only goes up"):
        c.inc(-1, ["x"])
    with pytest.raises(ValueError, match="takes labels"):
        c.inc(1)
    with pytest.raises(ValueError, match="already registered"):
        registry.add(Gauge("t_in_flight", "again"))
    assert [format_value(v) for v in (3.0, 0.25, float("inf"))] == ["3", "0.25", "+Inf"]
