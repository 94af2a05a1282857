"""The chat page in a real browser (Debian's chromium through Playwright, `make browser`)
against a real `inferd serve` with an API key: the page asks for the key, streams an answer
as it is generated, stops it (and the server aborts the generation), keeps the conversation
over a reload. A screenshot of the page goes to the test's tmp dir (and to
$INFERD_UI_SCREENSHOT when set: docs/ui_screenshot.png was made so)."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image
from playwright.sync_api import Browser, ConsoleMessage, Page, sync_playwright

from tests.server.live import LiveServer, live_server

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
KEY = "page-test-key"
LONG_MAX_TOKENS = 1500  # far more than is generated before the test presses Stop
CHAT_ROUTE = "/v1/chat/completions"
# greedy SmolLM2 writes hundreds of tokens for this one (the test stops it after a few)
STORY = "Write a very long story about a dragon and a knight."


@pytest.fixture(scope="module")
def keyed_server(
    smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("serve-ui") / "serve.log"
    args = ["-m", str(smollm2_gguf), "--api-key", KEY, "--max-seqs", "2", "--max-seq-len", "2048"]
    with live_server(args, log) as live:
        yield live


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh profile (empty storage) whose console errors (a CSP refusal, a script error)
    fail the test."""
    context = browser.new_context(viewport={"width": 1100, "height": 720})
    page = context.new_page()
    problems: list[str] = []

    def on_console(message: ConsoleMessage) -> None:
        # the page's own 401s (the key prompt) are logged by chromium as failed loads
        if message.type == "error" and "401" not in message.text:
            problems.append(message.text)

    page.on("console", on_console)
    page.on("pageerror", lambda error: problems.append(str(error)))
    yield page
    context.close()
    assert problems == []


def metrics_of(server: LiveServer) -> str:
    headers = {"Authorization": f"Bearer {KEY}"}  # ignored by a server without keys
    return httpx.get(server.url + "/metrics", headers=headers, timeout=10).text


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one series (0 when it has not been recorded yet)."""
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            return float(match.group(2))
    return 0.0


def enter_key(page: Page, key: str) -> None:
    page.fill("#key", key)
    page.click("#key-form button[type=submit]")


def open_page(page: Page, server: LiveServer) -> None:
    page.goto(server.url + "/")
    page.wait_for_selector("#key-dialog[open]")
    enter_key(page, KEY)
    page.wait_for_selector("body[data-ready=true]")


def answer_text(page: Page) -> str:
    return page.locator(".message.assistant .text").last.text_content() or ""


def wait_until(check: Callable[[], bool], timeout: float = 30) -> None:
    """Poll from here: the page's CSP (rightly) refuses wait_for_function's eval."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_the_page_asks_for_the_key_and_refuses_a_wrong_one(
    page: Page, keyed_server: LiveServer
) -> None:
    page.goto(keyed_server.url + "/")
    dialog = page.locator("#key-dialog")
    dialog.wait_for(state="visible")
    assert page.locator("#model option").count() == 0  # nothing listed without a key
    enter_key(page, "not-the-key")
    wait_until(lambda: bool(page.text_content("#key-error")))
    assert dialog.is_visible()
    assert "not accepted" in (page.text_content("#key-error") or "")
    enter_key(page, KEY)
    page.wait_for_selector("body[data-ready=true]")
    assert not dialog.is_visible()
    models = httpx.get(
        keyed_server.api + "/models", headers={"Authorization": f"Bearer {KEY}"}
    ).json()
    assert page.locator("#model option").all_text_contents() == [m["id"] for m in models["data"]]
    # SmolLM2 reads text only, so the page offers no image to attach
    assert models["data"][0]["modalities"]["input"] == ["text"]
    assert page.locator("#attach").is_hidden()
    assert page.evaluate("sessionStorage.getItem('inferd.chat.apiKey')") == KEY


def test_markup_in_a_conversation_is_shown_as_text(page: Page, keyed_server: LiveServer) -> None:
    """What a model wrote (here: a stored conversation) never becomes elements or script."""
    markup = '<img src=x onerror="window.pwned=1"><b>bold</b>'
    open_page(page, keyed_server)
    stored = [
        {
            "id": "c1",
            "title": markup,
            "updated": 1,
            "messages": [
                {"role": "user", "content": "Say some HTML."},
                {"role": "assistant", "content": markup},
            ],
        }
    ]
    page.evaluate("c => localStorage.setItem('inferd.chat.conversations', c)", json.dumps(stored))
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    assert page.locator(".message.assistant .text").text_content() == markup
    assert page.locator("#conversations .title").text_content() == markup
    assert page.locator("#messages b, #messages img, #conversations img").count() == 0
    assert page.evaluate("window.pwned === undefined")


def test_stream_stop_and_reload(page: Page, keyed_server: LiveServer, tmp_path: Path) -> None:
    before = metrics_of(keyed_server)
    disconnected = sample(
        before,
        "inferd_http_request_outcomes_total",
        route=CHAT_ROUTE,
        outcome="client_disconnected",
    )
    open_page(page, keyed_server)
    page.click("#settings summary")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(LONG_MAX_TOKENS))
    page.fill("#prompt", STORY)
    page.press("#prompt", "Enter")

    # the answer grows while it streams: seen at three moments, each longer than the last
    page.locator(".message.assistant").wait_for()
    lengths = [0]
    while len(lengths) < 4 or lengths[-1] < 40:  # a few words, for the screenshot too
        wait_until(lambda: len(answer_text(page)) > lengths[-1])
        lengths.append(len(answer_text(page)))
    assert lengths == sorted(set(lengths))
    assert page.locator("#stop").is_visible() and page.locator("#send").is_hidden()

    page.click("#stop")
    page.locator("#send").wait_for(state="visible")
    stopped_text = answer_text(page)
    assert len(stopped_text) >= lengths[-1]
    meta = page.locator(".message.assistant .meta").last.text_content() or ""
    assert "stopped" in meta and "TTFT" in meta

    # the server saw the client leave and aborted the generation: the disconnect is counted,
    # nothing runs any more, and far fewer tokens were made than were asked for
    deadline = time.monotonic() + 15
    while True:
        after = metrics_of(keyed_server)
        left = sample(
            after,
            "inferd_http_request_outcomes_total",
            route=CHAT_ROUTE,
            outcome="client_disconnected",
        )
        running = sample(after, "inferd_requests_running")
        if (left, running) == (disconnected + 1, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert (left, running) == (disconnected + 1, 0)
    made = sample(after, "inferd_generation_tokens_total") - sample(
        before, "inferd_generation_tokens_total"
    )
    assert 0 < made < LONG_MAX_TOKENS / 2
    assert answer_text(page) == stopped_text  # nothing came after Stop

    # a short answer that ends on its own shows its speed
    page.fill("#max-tokens", "48")
    page.fill("#prompt", "What is the capital of France?")
    page.click("#send")
    page.locator("#stop").wait_for(state="visible")
    page.locator("#send").wait_for(state="visible", timeout=30_000)
    meta = page.locator(".message.assistant .meta").last.text_content() or ""
    assert re.search(r"TTFT \d+\.\d\d s · \d+\.\d tokens/s · \d+ tokens", meta), meta
    assert "stopped" not in meta and "Error" not in meta
    second_answer = answer_text(page)
    assert second_answer

    shot = tmp_path / "ui_screenshot.png"
    page.screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000
    if copy_to := os.environ.get("INFERD_UI_SCREENSHOT"):
        shutil.copyfile(shot, copy_to)

    # a reload finds the conversation (storage, not the server): its title, both turns
    page.reload()
    page.wait_for_selector("body[data-ready=true]")  # the key is still in this tab
    titles = page.locator("#conversations .title").all_text_contents()
    assert titles == [STORY[:47] + "…"]  # its first words
    texts = page.locator(".message .text").all_text_contents()
    assert texts == [
        STORY,
        stopped_text,
        "What is the capital of France?",
        second_answer,
    ]
    assert page.input_value("#max-tokens") == "48"  # settings are kept too

    # a new conversation joins the list; deleting it leaves the first one shown
    page.click("#new-chat")
    assert page.locator("#conversations li").count() == 2
    assert page.locator(".message").count() == 0
    page.locator("#conversations li.active .delete").click()
    assert page.locator("#conversations .title").all_text_contents() == titles
    assert page.locator(".message .text").all_text_contents() == texts


@pytest.fixture(scope="module")
def vision_server(
    tiny_idefics3: tuple[Path, Any, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """A tiny random SmolVLM: it reads images (its words are noise, which is fine here)."""
    log = tmp_path_factory.mktemp("serve-ui-vision") / "serve.log"
    with live_server(["-m", str(tiny_idefics3[0]), "--dtype", "f32"], log) as live:
        yield live


def test_an_image_goes_with_the_message_when_the_model_takes_images(
    page: Page, vision_server: LiveServer, tmp_path: Path
) -> None:
    picture = tmp_path / "picture.png"
    Image.new("RGB", (64, 48), (200, 60, 30)).save(picture)
    encoded = sample(metrics_of(vision_server), "inferd_images_encoded_total")
    page.goto(vision_server.url + "/")  # no --api-key: no key asked
    page.wait_for_selector("body[data-ready=true]")
    assert page.locator("#key-dialog").is_hidden()
    assert page.locator("#attach").is_visible()
    page.set_input_files("#image", str(picture))
    page.locator("#attachment-preview").wait_for()
    page.click("#settings summary")
    page.fill("#max-tokens", "4")
    page.fill("#prompt", "What is in this picture?")
    page.click("#send")
    page.locator("#send").wait_for(state="visible", timeout=30_000)
    meta = page.locator(".message.assistant .meta").last.text_content() or ""
    assert "Error" not in meta and "4 tokens" in meta, meta
    assert page.locator("#attachment").is_hidden()  # sent with this message, not the next
    # the server ran its image encoder on it, and the conversation keeps the picture
    assert sample(metrics_of(vision_server), "inferd_images_encoded_total") == encoded + 1
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    shown = page.locator(".message.user img")
    assert shown.count() == 1
    assert (shown.get_attribute("src") or "").startswith("data:image/png;base64,")
