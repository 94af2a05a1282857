"""The chat page's serving in-process (no model needed): where it is served, with which
headers, and when not at all. The page itself runs in a browser in test_chat_page_live.py."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from inferd.cli import _parser
from inferd.media import sniff
from inferd.server.app import build_app
from inferd.server.chat_page import ASSETS
from inferd.server.media import _INPUT_AUDIO_FORMATS
from inferd.server.options import ServerOptions
from inferd.server.serve_args import server_options


def _get(app: object, *paths: str, headers: dict[str, str] | None = None) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [await client.get(p, headers=headers) for p in paths]

    return asyncio.run(run())


def _directives(csp: str) -> dict[str, str]:
    pairs = (d.strip().partition(" ") for d in csp.split(";") if d.strip())
    return {name: value.strip() for name, _, value in pairs}


def test_the_page_and_its_assets_are_served_with_a_strict_policy() -> None:
    page, script, style = _get(build_app([], ServerOptions(ui=True)), *ASSETS)
    assert [r.status_code for r in (page, script, style)] == [200, 200, 200]
    assert page.headers["content-type"].startswith("text/html")
    assert script.headers["content-type"].startswith("text/javascript")
    assert style.headers["content-type"].startswith("text/css")
    # the page loads exactly the two assets served beside it, by relative URL
    assert 'src="ui/app.js"' in page.text and 'href="ui/style.css"' in page.text
    assert "v1/chat/completions" in script.text and "v1/models" in script.text
    csp = _directives(page.headers["content-security-policy"])
    assert csp["default-src"] == "'none'"
    assert csp["script-src"] == "'self'" and csp["style-src"] == "'self'"
    assert csp["connect-src"] == "'self'" and csp["frame-ancestors"] == "'none'"
    assert csp["media-src"] == "data:"  # an attached clip played back, nothing else
    assert not any("unsafe" in value or "http" in value for value in csp.values())
    assert page.headers["x-content-type-options"] == "nosniff"


def test_the_page_never_writes_markup() -> None:
    """Model output goes on the page as text: the script never parses strings as HTML."""
    (script,) = _get(build_app([], ServerOptions(ui=True)), "/ui/app.js")
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script.text


def test_the_page_attaches_each_medium_as_the_chat_api_takes_it() -> None:
    """A button (hidden until a model reads that medium) per image, audio and video, several
    files each; audio goes as input_audio in a format the server takes for that file's type."""
    page, script = _get(build_app([], ServerOptions(ui=True)), "/", "/ui/app.js")
    for kind in ("image", "audio", "video"):
        button = re.search(rf'<label id="attach-{kind}"[^>]*>.*?</label>', page.text)
        assert button is not None and " hidden " in button.group(0)
        assert f'<input id="{kind}" type="file" accept="{kind}/*" multiple>' in button.group(0)
    for part in ("image_url", "input_audio", "video_url"):
        assert f'type: "{part}"' in script.text
    by_type = _table(script.text, "AUDIO_TYPES")
    by_extension = _table(script.text, "AUDIO_EXTENSIONS")
    assert set(by_type.values()) | set(by_extension.values()) == set(_INPUT_AUDIO_FORMATS) - {
        "pcm16"  # raw samples: no file is of that type
    }
    # the server checks the format sent (as audio/FORMAT) against the bytes: a file of each
    # type the page knows must pass as the format the page names for it
    formats = [sniff.WAV, sniff.FLAC, sniff.MP3, sniff.OGG, sniff.MP4, sniff.MATROSKA]
    for media_type, fmt in by_type.items():
        (found,) = [f for f in formats if media_type in f.media_types]
        assert f"audio/{fmt}" in found.media_types, media_type


def _table(script: str, name: str) -> dict[str, str]:
    """A `const NAME = { key: "value", ... };` of app.js as a dict."""
    found = re.search(rf"const {name} = \{{(.*?)\}};", script, re.S)
    assert found is not None, name
    return dict(re.findall(r'"?([\w/.-]+)"?: "(\w+)"', found.group(1)))


def test_ui_off_is_404_and_embedders_get_no_page_unless_asked() -> None:
    for options in (ServerOptions(ui=False), ServerOptions()):
        page, script = _get(build_app([], options), "/", "/ui/app.js")
        assert (page.status_code, script.status_code) == (404, 404)
        assert page.json()["error"]["message"] == "no route GET /"


@pytest.mark.parametrize(
    ("flags", "served"),
    [
        ([], True),  # loopback by default
        (["--host", "::1"], True),
        (["--ui", "off"], False),
        (["--host", "0.0.0.0"], False),  # reachable from elsewhere: only when asked
        (["--host", "192.0.2.7"], False),
        (["--host", "0.0.0.0", "--ui", "on"], True),
    ],
)
def test_serve_flags_choose_the_page(flags: list[str], served: bool) -> None:
    options = server_options(_parser().parse_args(["serve", *flags]), {})
    assert options.ui is served


def test_with_an_api_key_the_page_is_open_and_the_api_is_not() -> None:
    """The page must load to ask for the key; everything it calls still needs one."""
    app = build_app([], ServerOptions(ui=True, api_keys=("sekrit",)))
    page, script, models, metrics = _get(app, "/", "/ui/app.js", "/v1/models", "/metrics")
    assert (page.status_code, script.status_code) == (200, 200)
    assert (models.status_code, metrics.status_code) == (401, 401)
    (keyed,) = _get(app, "/v1/models", headers={"Authorization": "Bearer sekrit"})
    assert keyed.status_code == 200
