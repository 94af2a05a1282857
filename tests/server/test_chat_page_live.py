"""The chat page in a real browser (Debian's chromium through Playwright, `make browser`)
against a real `inferd serve` with an API key: the page asks for the key, streams an answer
as it is generated, stops it (and the server aborts the generation), keeps the conversation
over a reload. A screenshot of the page goes to the test's tmp dir (and to
$INFERD_UI_SCREENSHOT when set: docs/ui_screenshot.png was made so)."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image
from playwright.sync_api import Browser, ConsoleMessage, Page, Request, sync_playwright

from tests.media.corpus import Clip, Tone, _mp4, wav_bytes
from tests.models.tiny_gemma4 import VIDEO_FRAMES
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
def expected_statuses() -> set[int]:
    """The error statuses a test's requests are meant to get (chromium logs each as a failed
    load): the key prompt's 401s, and what a test adds."""
    return {401}


@pytest.fixture
def page(browser: Browser, expected_statuses: set[int]) -> Iterator[Page]:
    """A fresh profile (empty storage) whose console errors (a CSP refusal, a script error, a
    status the test did not expect) fail the test."""
    context = browser.new_context(viewport={"width": 1100, "height": 720})
    page = context.new_page()
    problems: list[str] = []

    def on_console(message: ConsoleMessage) -> None:
        status = re.search(r"responded with a status of (\d+)", message.text)
        if message.type == "error" and not (status and int(status[1]) in expected_statuses):
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
    # SmolLM2 reads text only, so the page offers nothing to attach
    assert models["data"][0]["modalities"]["input"] == ["text"]
    assert page.locator("label.attach").count() == 3
    assert page.locator("label.attach:visible").count() == 0
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


MAX_MEDIA_BYTES = 64 * 1024  # more than each file of the first test, less than a 3 s WAV


@pytest.fixture(scope="module")
def multimodal_server(
    tiny_gemma4: tuple[Path, Any, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """A tiny random Gemma 4: it reads images, audio and video (its words are noise, which is
    fine here); media up to MAX_MEDIA_BYTES each."""
    log = tmp_path_factory.mktemp("serve-ui-gemma4") / "serve.log"
    args = ["-m", str(tiny_gemma4[0]), "--dtype", "f32", "--max-media-bytes", str(MAX_MEDIA_BYTES)]
    with live_server(args, log) as live:
        yield live


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def media_on_page(page: Page, where: str) -> list[tuple[str, str]]:
    """(tag, src scheme and type) of each img, audio and video under ``where``, in order."""
    found = page.locator(f"{where} img, {where} audio, {where} video")
    return [
        (found.nth(i).evaluate("e => e.tagName"), (found.nth(i).get_attribute("src") or "")[:15])
        for i in range(found.count())
    ]


def streamed_text(body: str) -> str:
    """The content deltas of a chat completion's event stream, joined."""
    events = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def test_an_image_a_sound_and_a_clip_go_with_one_message(
    page: Page, multimodal_server: LiveServer, tmp_path: Path
) -> None:
    """Each medium the model reads gets its button; the files chosen (one taken back) go in
    one request as image_url, input_audio and video_url parts in the order chosen; the message
    shows them, the conversation keeps them over a reload, and when storage is full keeps the
    words and says which media it dropped."""
    Image.new("RGB", (64, 48), (200, 60, 30)).save(tmp_path / "picture.png")
    Image.new("RGB", (64, 48)).save(tmp_path / "second.png")
    (tmp_path / "tone.wav").write_bytes(wav_bytes(Tone(16000, 0.8, (440.0,))))
    (tmp_path / "clip.mp4").write_bytes(_mp4(Clip(fps=Fraction(8), frames=12, size=(32, 24)), None))
    files = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    encoded = sample(metrics_of(multimodal_server), "inferd_images_encoded_total")
    page.goto(multimodal_server.url + "/")  # no --api-key: no key asked
    page.wait_for_selector("body[data-ready=true]")
    assert page.locator("#key-dialog").is_hidden()
    assert page.locator("label.attach:visible").all_text_contents() == ["Image", "Audio", "Video"]

    page.set_input_files("#image", str(tmp_path / "picture.png"))
    page.set_input_files("#audio", str(tmp_path / "tone.wav"))
    page.set_input_files("#image", str(tmp_path / "second.png"))
    page.locator("#attachments .chip").nth(2).locator("img").wait_for()
    page.click("#attachments [aria-label='Remove second.png']")
    page.set_input_files("#video", str(tmp_path / "clip.mp4"))
    page.locator("#attachments .chip video").wait_for()
    assert media_on_page(page, "#attachments") == [
        ("IMG", "data:image/png;"),
        ("AUDIO", "data:audio/wav;"),
        ("VIDEO", "data:video/mp4;"),
    ]

    posted: list[Request] = []
    page.on("request", lambda r: posted.append(r) if r.url.endswith(CHAT_ROUTE) else None)
    page.click("#settings summary")
    page.fill("#max-tokens", "4")
    page.fill("#prompt", "What are these?")
    with page.expect_response(lambda r: r.url.endswith(CHAT_ROUTE)) as answered:
        page.click("#send")
    page.locator("#send").wait_for(state="visible", timeout=60_000)
    assert answered.value.status == 200
    assert answered.value.headers["content-type"].startswith("text/event-stream")
    meta = page.locator(".message.assistant .meta").last.text_content() or ""
    assert "Error" not in meta and "4 tokens" in meta, meta
    assert answer_text(page) == streamed_text(answered.value.text())
    assert page.locator("#attachments").is_hidden()  # sent with this message, not the next
    assert len(posted) == 1
    (user,) = posted[0].post_data_json["messages"]
    assert user["content"] == [
        {"type": "text", "text": "What are these?"},
        {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64," + b64(files["picture.png"])},
        },
        {"type": "input_audio", "input_audio": {"data": b64(files["tone.wav"]), "format": "wav"}},
        {
            "type": "video_url",
            "video_url": {"url": "data:video/mp4;base64," + b64(files["clip.mp4"])},
        },
    ]
    # the server ran its encoders on all three: the picture, the sound and the clip's frames
    after = sample(metrics_of(multimodal_server), "inferd_images_encoded_total")
    assert after == encoded + 1 + 1 + VIDEO_FRAMES
    sent = [("IMG", "data:image/png;"), ("AUDIO", "data:audio/wav;"), ("VIDEO", "data:video/mp4;")]
    assert media_on_page(page, ".message.user") == sent

    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    assert media_on_page(page, ".message.user") == sent

    # storage all but full: the next save cannot keep the media, so it keeps the words
    page.evaluate(FILL_STORAGE)
    page.fill("#prompt", "And now?")
    page.click("#send")
    page.locator("#send").wait_for(state="visible", timeout=60_000)
    assert "not kept after a reload" in (page.text_content("#status") or "")
    assert media_on_page(page, ".message.user") == sent  # still here until the reload
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    assert media_on_page(page, ".message.user") == []
    notes = page.locator(".message.user .note").all_text_contents()
    assert notes == ["(image not kept)", "(audio not kept)", "(video not kept)"]
    texts = page.locator(".message.user .text").all_text_contents()
    assert texts == ["What are these?", "And now?"]


def test_a_file_over_the_server_limit_is_refused_and_the_chat_goes_on(
    page: Page, multimodal_server: LiveServer, tmp_path: Path, expected_statuses: set[int]
) -> None:
    """The page cannot read --max-media-bytes: the server's 400 says what is wrong on the
    answer, and the refused turn is not sent again, so the next message gets an answer."""
    long_tone = tmp_path / "long.wav"
    long_tone.write_bytes(wav_bytes(Tone(16000, 3.0, (440.0,))))
    assert long_tone.stat().st_size > MAX_MEDIA_BYTES
    expected_statuses.add(400)
    page.goto(multimodal_server.url + "/")
    page.wait_for_selector("body[data-ready=true]")
    page.click("#settings summary")
    page.fill("#max-tokens", "4")
    page.set_input_files("#audio", str(long_tone))
    page.locator("#attachments audio").wait_for()
    page.fill("#prompt", "Listen.")
    page.click("#send")
    page.locator(".message.assistant .meta .error").wait_for(timeout=30_000)
    assert page.locator(".message.assistant .meta").last.text_content() == (
        "Error: messages.0.content.1.input_audio.data: the media is larger than "
        f"{MAX_MEDIA_BYTES} bytes (--max-media-bytes)"
    )

    posted: list[Request] = []
    page.on("request", lambda r: posted.append(r) if r.url.endswith(CHAT_ROUTE) else None)
    page.fill("#prompt", "Hello?")
    with page.expect_response(lambda r: r.url.endswith(CHAT_ROUTE)) as answered:
        page.click("#send")
    page.locator("#send").wait_for(state="visible", timeout=60_000)
    assert answered.value.status == 200
    assert [r.post_data_json["messages"] for r in posted] == [
        [{"role": "user", "content": "Hello?"}]
    ]
    meta = page.locator(".message.assistant .meta").last.text_content() or ""
    assert "Error" not in meta and "4 tokens" in meta, meta


# Fill localStorage to within a few characters of its quota (found by bisection).
FILL_STORAGE = """() => {
  let low = 0, high = 16 * 1024 * 1024;
  while (high - low > 8) {
    const mid = Math.floor((low + high) / 2);
    try { localStorage.setItem("filler", "x".repeat(mid)); low = mid; } catch { high = mid; }
  }
  localStorage.setItem("filler", "x".repeat(low));
}"""
