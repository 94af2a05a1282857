"""The chat page's serving in-process (no model needed): where it is served, with which
headers, and when not at all. The page itself runs in a browser in test_chat_page_live.py."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from inferd.cli import _parser
from inferd.server.app import build_app
from inferd.server.chat_page import ASSETS
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
    assert not any("unsafe" in value or "http" in value for value in csp.values())
    assert page.headers["x-content-type-options"] == "nosniff"


def test_the_page_never_writes_markup() -> None:
    """Model output goes on the page as text: the script never parses strings as HTML."""
    (script,) = _get(build_app([], ServerOptions(ui=True)), "/ui/app.js")
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script.text


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
