"""Operational settings in-process (no model needed): options, switches, validation, metrics."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from inferd import __version__
from inferd.cli import _parser, main
from inferd.engine.outputs import RequestOutput
from inferd.media.limits import MediaLimits
from inferd.server.app import build_app
from inferd.server.auth import keys_from_env
from inferd.server.crosssite import HostAllowList
from inferd.server.limits import RequestDeadline, RequestTimeoutError
from inferd.server.options import ServerOptions
from inferd.server.serve_args import describe, server_options
from inferd.store import default_home


def _get(app: object, *paths: str) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [await client.get(p) for p in paths]

    return asyncio.run(run())


def test_metrics_and_docs_can_be_switched_off() -> None:
    on = _get(build_app([]), "/metrics", "/openapi.json")
    assert [r.status_code for r in on] == [200, 200]
    options = ServerOptions(metrics=False, docs=False)
    off = _get(build_app([], options), "/metrics", "/docs", "/openapi.json")
    assert [r.status_code for r in off] == [404, 404, 404]
    assert off[0].json()["error"]["message"] == "no route GET /metrics"


def test_the_document_is_also_at_api_doc_and_under_a_base_path() -> None:
    """Where mistral.rs serves it (/api-doc/openapi.json), and under --docs-base-path."""
    plain = _get(build_app([]), "/openapi.json", "/api-doc/openapi.json")
    assert [r.status_code for r in plain] == [200, 200]
    assert plain[0].json() == plain[1].json() and "/v1/chat/completions" in plain[0].json()["paths"]
    app = build_app([], ServerOptions(docs_base_path="/internal"))
    moved = _get(app, "/internal/openapi.json", "/internal/api-doc/openapi.json", "/openapi.json")
    assert [r.status_code for r in moved] == [200, 200, 404]
    assert moved[0].json() == moved[1].json() == plain[0].json()
    off = _get(build_app([], ServerOptions(docs=False)), "/api-doc/openapi.json")
    assert off[0].status_code == 404


def test_a_bad_docs_base_path_is_refused() -> None:
    for bad in ("internal", "/internal/", "/a b", "/../x", "/./x"):
        args = _parser().parse_args(["serve", "--docs-base-path", bad])
        with pytest.raises(ValueError, match="--docs-base-path"):
            server_options(args, {})
    good = _parser().parse_args(["serve", "--docs-base-path", "/internal/v2"])
    assert server_options(good, {}).docs_base_path == "/internal/v2"


def test_no_page_loads_anything_from_another_origin() -> None:
    """FastAPI's /docs and /redoc pull unpinned JavaScript from a CDN into the API's origin:
    not served. Every page and asset the server does serve refers to its own origin only."""
    app = build_app([], ServerOptions(ui=True))
    gone = _get(app, "/docs", "/redoc", "/docs/oauth2-redirect")
    assert [r.status_code for r in gone] == [404, 404, 404]
    served = _get(app, "/", "/ui/app.js", "/ui/style.css", "/openapi.json", "/metrics")
    assert [r.status_code for r in served] == [200] * 5
    for resp in served:
        # any absolute or scheme-relative URL (src="//cdn...", url(https://...), import ...)
        assert re.findall(r"(?:https?:)?//[\w.-]+\.[a-z]{2,}", resp.text) == [], resp.url


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
        allowed_hosts=HostAllowList.for_server("127.0.0.1", 1234),
        responses_store=str(default_home() / "responses.sqlite3"),
        files_dir=str(default_home() / "files"),  # beside the responses store
        ui=True,
    )
    # `inferd serve` always checks Host (the loopback names and its own address), and keeps
    # stored responses in a file under INFERD_HOME unless told otherwise; on loopback it
    # serves the chat page
    loopback = HostAllowList.for_server("127.0.0.1", 1234)
    assert server_options(parser.parse_args(["serve"]), {}) == ServerOptions(
        allowed_hosts=loopback,
        responses_store=str(default_home() / "responses.sqlite3"),
        files_dir=str(default_home() / "files"),
        ui=True,
    )
    flags = ["serve", "--responses-store", ":memory:", "--responses-ttl", "60"]
    stored = server_options(parser.parse_args(flags), {})
    assert (stored.responses_store, stored.responses_ttl) == (":memory:", 60.0)
    with pytest.raises(ValueError, match="--responses-ttl"):
        server_options(parser.parse_args(["serve", "--responses-ttl", "0"]), {})


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
        (["--max-num-audios", "-1"], "--max-num-audios must not be negative"),
        (["--max-image-pixels", "0"], "--max-image-pixels must be at least 1"),
        (["--max-video-seconds", "0"], "--max-video-seconds must be positive"),
        (["--max-audio-sample-rate", "0"], "--max-audio-sample-rate must be at least 1"),
    ],
)
def test_serve_flags_are_checked_before_the_model_loads(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing_model = str(tmp_path / "never-loaded.gguf")
    assert main(["serve", "-m", missing_model, *flags]) == 2
    assert message in capsys.readouterr().err


def test_media_flags_reach_the_policy_and_the_startup_lines() -> None:
    flags = [
        *("serve", "--max-num-images", "3", "--max-num-audios", "2", "--max-num-videos", "0"),
        *("--max-image-pixels", "4000000", "--max-video-seconds", "30", "--max-video-frames"),
        *("900", "--max-audio-seconds", "45.5", "--max-audio-sample-rate", "48000"),
        *("--max-edge", "1024"),
    ]
    options = server_options(_parser().parse_args(flags), {})
    policy = options.media_policy
    assert (policy.max_num_images, policy.max_num_audios, policy.max_num_videos) == (3, 2, 0)
    assert policy.limits == MediaLimits(
        max_image_pixels=4_000_000,
        max_video_seconds=30.0,
        max_video_frames=900,
        max_audio_seconds=45.5,
        max_audio_sample_rate=48_000,
        max_image_edge=1024,
    )
    lines = describe(options)
    media = "media      data:; at most 3 images, 2 audio clips, 0 videos, 20971520 bytes each"
    assert media in lines
    assert (
        "decoding   images up to 4000000 pixels, scaled to 1024 px on the long side "
        "(--max-edge); video up to 30 s and 900 frames; audio up to "
        "45.5 s at 48000 Hz"
    ) in lines
    alias = server_options(_parser().parse_args(["serve", "--max-image-length", "512"]), {})
    assert alias.media_policy.limits.max_image_edge == 512
    defaults = server_options(_parser().parse_args(["serve"]), {}).media_policy
    assert defaults.limits == MediaLimits() and defaults.max_num_videos == 2


def test_api_keys_from_the_environment() -> None:
    assert keys_from_env({}) == []
    assert keys_from_env({"INFERD_API_KEYS": ""}) == []
    assert keys_from_env({"INFERD_API_KEYS": " a, b ,,c "}) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="holds no keys"):
        keys_from_env({"INFERD_API_KEYS": " , ,"})


def _samples(body: str) -> dict[str, float]:
    samples = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


HEALTH_200 = 'inferd_http_requests_total{method="GET",route="/health",status="200"}'


def test_two_apps_in_one_process_count_apart() -> None:
    first, second = build_app([]), build_app([])
    *_, first_scrape = _get(first, "/health", "/health", "/health", "/metrics")
    *_, second_scrape = _get(second, "/health", "/metrics")
    assert first_scrape.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert _samples(first_scrape.text)[HEALTH_200] == 3
    assert _samples(second_scrape.text)[HEALTH_200] == 1
    assert _samples(second_scrape.text)["inferd_http_requests_in_flight"] == 1  # the scrape
    for text in (first_scrape.text, second_scrape.text):
        assert "# TYPE inferd_http_request_duration_seconds histogram" in text
        assert "# TYPE inferd_kv_blocks_used gauge" in text  # engine series, no model loaded
        assert f'inferd_build_info{{version="{__version__}"}}' in _samples(text)


_WORKER = """
import asyncio, sys
import httpx
from inferd.engine.outputs import RequestOutput
from inferd.media.limits import MediaLimits
from inferd.server.app import build_app
from inferd.server.limits import RequestDeadline, RequestTimeoutError

async def main(health: int, scrape: bool) -> None:
    transport = httpx.ASGITransport(app=build_app([]))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        for _ in range(health):
            assert (await client.get("/health")).status_code == 200
        if scrape:
            print((await client.get("/metrics")).text)

asyncio.run(main(int(sys.argv[1]), sys.argv[2] == "scrape"))
"""


def test_metrics_of_worker_processes_sum_in_a_multiprocess_directory(tmp_path: Path) -> None:
    """With PROMETHEUS_MULTIPROC_DIR, a scrape of one worker counts every worker's requests."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}

    def worker(health: int, scrape: bool) -> str:
        argv = [sys.executable, "-c", _WORKER, str(health), "scrape" if scrape else "-"]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout

    worker(2, scrape=False)
    samples = _samples(worker(3, scrape=True))
    assert samples[HEALTH_200] == 5
    assert samples['inferd_http_request_duration_seconds_count{method="GET",route="/health"}'] == 5
    assert list(tmp_path.glob("counter_*.db"))  # the values went through the directory


def test_a_deadline_closes_the_stream_it_bounds_and_says_so() -> None:
    """The engine stream is closed (its request aborted) when the deadline passes."""
    closed = asyncio.Event()

    async def stalled() -> AsyncIterator[RequestOutput]:
        try:
            yield RequestOutput("r", "a", (1,), None, num_prompt_tokens=3, num_output_tokens=1)
            await asyncio.Event().wait()  # the next token never comes
            yield RequestOutput("r", "b", (2,), "stop", num_prompt_tokens=3, num_output_tokens=2)
        finally:
            closed.set()

    async def run() -> tuple[RequestDeadline, list[str]]:
        deadline = RequestDeadline.after(0.05)
        seen = []
        with pytest.raises(RequestTimeoutError, match=re.escape("timed out after 0.05s")):
            async for out in deadline.bound(stalled()):
                seen.append(out.text)
        return deadline, seen

    deadline, seen = asyncio.run(run())
    assert seen == ["a"] and deadline.expired and closed.is_set()
