"""Operations on a real `inferd serve`: auth, limits, CORS, metrics, access log, media policy.

One server for the module, started with the operational flags; every request goes over a real
loopback socket, through the official SDKs where they apply.
"""

from __future__ import annotations

import base64
import json
import re
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.server.live import LiveServer, live_server

KEYS = ("key-one", "key-two")
ORIGIN = "http://app.example"
MAX_BODY = 65536
MAX_HEADER = 8192
MAX_MEDIA = 4096
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 56
PROMPT_MARKER = "zebra-marker-5512"
AUTH = {"Authorization": f"Bearer {KEYS[0]}"}
JSON = {"content-type": "application/json"}
ROUTE = 'route="/v1/chat/completions"'


@dataclass(frozen=True)
class Ops:
    server: LiveServer
    media: Path
    secret: Path
    payloads: Path

    @property
    def url(self) -> str:
        return self.server.url


@pytest.fixture(scope="module")
def ops(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ops]:
    tmp = tmp_path_factory.mktemp("ops")
    media = tmp / "media-root"
    media.mkdir()
    (media / "cat-7781.png").write_bytes(PNG)
    secret = tmp / "secret.txt"
    secret.write_text("not for you")
    (media / "escape.png").symlink_to(secret)
    payloads = tmp / "payloads.jsonl"
    args = [
        *("-m", str(smollm2_gguf), "--dtype", "f32", "--max-seqs", "4", "--max-seq-len", "1024"),
        *("--api-key", KEYS[0], "--api-key", KEYS[1]),
        *("--max-body-bytes", str(MAX_BODY), "--max-header-bytes", str(MAX_HEADER)),
        *("--allowed-origins", ORIGIN, "--access-log-format", "json"),
        *("--log-payloads", str(payloads)),
        *("--allowed-media-root", str(media), "--max-num-images", "2"),
        *("--max-media-bytes", str(MAX_MEDIA), "--max-num-audios", "1", "--max-num-videos", "1"),
        *("--max-image-pixels", "1000000", "--max-audio-seconds", "30"),
    ]
    with live_server(args, tmp / "serve.log") as live:
        yield Ops(live, media, secret, payloads)


@pytest.fixture(scope="module")
def http(ops: Ops) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=ops.url, headers=AUTH, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def model(http: httpx.Client) -> str:
    return str(http.get("/v1/models").json()["data"][0]["id"])


def scrape(http: httpx.Client) -> dict[str, float]:
    """Every sample of /metrics, keyed by its full name with labels (in name order, as
    prometheus_client writes them)."""
    resp = http.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for line in resp.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def access_lines(ops: Ops) -> list[dict[str, Any]]:
    lines = []
    for line in ops.server.log.read_text().splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            if entry.get("event") in ("request_start", "request_end"):
                lines.append(entry)
    return lines


def wait_for_end(ops: Ops, request_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for entry in access_lines(ops):
            if entry["request_id"] == request_id and entry["event"] == "request_end":
                return entry
        time.sleep(0.1)
    raise AssertionError(f"no request_end line for {request_id}")


def chat(content: Any, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


def _prompt_tokens(http: httpx.Client, body: dict[str, Any]) -> int:
    """The prompt tokens a complete run of ``body``'s messages is billed."""
    resp = http.post("/v1/chat/completions", json={**body, "max_tokens": 1})
    return int(resp.raise_for_status().json()["usage"]["prompt_tokens"])


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def openai_error(resp: httpx.Response) -> dict[str, Any]:
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return dict(body["error"])


def anthropic_error(resp: httpx.Response) -> dict[str, Any]:
    body = resp.json()
    assert body["type"] == "error" and set(body) == {"type", "error", "request_id"}
    assert body["request_id"] == resp.headers["x-request-id"]
    assert set(body["error"]) == {"type", "message"}
    return dict(body["error"])


# -- auth ----------------------------------------------------------------------------------------
def test_health_is_open_and_everything_else_needs_a_key(ops: Ops) -> None:
    with httpx.Client(base_url=ops.url, timeout=30) as bare:
        assert bare.get("/health").json() == {"status": "ok"}
        for path in ("/v1/models", "/metrics", "/openapi.json", "/docs", "/nowhere"):
            resp = bare.get(path)
            assert resp.status_code == 401, path
            assert resp.headers["www-authenticate"] == "Bearer"
            err = openai_error(resp)
            assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
            assert err["message"].startswith("this server requires an API key")


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": f"Bearer {KEYS[0]}"},
        {"Authorization": f"bearer {KEYS[1]}"},
        {"Authorization": f"BEARER   {KEYS[0]}"},
        {"x-api-key": KEYS[1]},
        {"Authorization": "Basic Zm9vOmJhcg==", "x-api-key": KEYS[0]},
    ],
)
def test_either_key_in_either_header_is_accepted(ops: Ops, headers: dict[str, str]) -> None:
    with httpx.Client(base_url=ops.url, timeout=30) as client:
        assert client.get("/v1/models", headers=headers).status_code == 200


def test_openai_sdk_sees_authentication_errors(ops: Ops, model: str) -> None:
    with openai.OpenAI(
        base_url=ops.url + "/v1", api_key="wrong", max_retries=0, _strict_response_validation=True
    ) as client:
        with pytest.raises(openai.AuthenticationError) as info:
            client.models.list()
        assert info.value.status_code == 401
        assert info.value.body == {
            "message": "the API key is not valid for this server",
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        }
    with openai.OpenAI(
        base_url=ops.url + "/v1", api_key=KEYS[1], max_retries=0, _strict_response_validation=True
    ) as client:
        assert client.models.list().data[0].id == model


def test_anthropic_sdk_sees_authentication_errors_in_its_envelope(ops: Ops, model: str) -> None:
    with anthropic.Anthropic(
        base_url=ops.url, api_key="wrong", max_retries=0, _strict_response_validation=True
    ) as client:
        with pytest.raises(anthropic.AuthenticationError) as info:
            client.messages.count_tokens(model=model, messages=[{"role": "user", "content": "hi"}])
        assert info.value.status_code == 401
        assert info.value.body == {
            "type": "error",
            "error": {
                "type": "authentication_error",
                "message": "the API key is not valid for this server",
            },
            "request_id": info.value.response.headers["x-request-id"],
        }
    with anthropic.Anthropic(
        base_url=ops.url, api_key=KEYS[0], max_retries=0, _strict_response_validation=True
    ) as client:
        count = client.messages.count_tokens(
            model=model, messages=[{"role": "user", "content": "hi"}]
        )
        assert count.input_tokens > 0


# -- limits --------------------------------------------------------------------------------------
def test_bodies_over_the_limit_get_413_whether_declared_or_streamed(http: httpx.Client) -> None:
    big = b"{" + b" " * MAX_BODY + b"}"
    resp = http.post("/v1/chat/completions", content=big, headers=JSON)
    assert resp.status_code == 413
    err = openai_error(resp)
    assert err["code"] == "request_too_large"
    assert err["message"] == (
        f"the request body is larger than this server's limit of {MAX_BODY} bytes "
        "(--max-body-bytes)"
    )

    def chunks() -> Iterator[bytes]:
        for _ in range(MAX_BODY // 4096 + 2):
            yield b" " * 4096

    resp = http.post("/v1/chat/completions", content=chunks(), headers=JSON)  # chunked
    assert resp.status_code == 413
    assert "larger than this server's limit" in openai_error(resp)["message"]

    resp = http.post("/v1/messages", content=big, headers={"anthropic-version": "2023-06-01"})
    assert resp.status_code == 413
    assert anthropic_error(resp)["type"] == "request_too_large"

    # just under the limit is read and judged on its content
    resp = http.post(
        "/v1/chat/completions", content=b"[" + b" " * (MAX_BODY - 2) + b"]", headers=JSON
    )
    assert resp.status_code == 400
    assert openai_error(resp)["message"] == "the request body must be a JSON object"


def test_heads_over_the_limit_are_refused(http: httpx.Client, ops: Ops) -> None:
    resp = http.get("/v1/models", headers={"x-padding": "a" * MAX_HEADER})
    assert resp.status_code == 431
    assert (
        "request line and headers are larger than this server's limit of 8192 bytes"
        in (openai_error(resp)["message"])
    )
    # a head that trickles in past the limit is cut off by the HTTP layer itself
    port = int(ops.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        for _ in range(4):
            sock.sendall(b"x-pad: " + b"a" * 4000 + b"\r\n")
            time.sleep(0.05)
        reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 400")
    assert http.get("/health").status_code == 200


# -- CORS ----------------------------------------------------------------------------------------
def test_cors_answers_only_the_allowed_origin(ops: Ops) -> None:
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    with httpx.Client(base_url=ops.url, timeout=30) as bare:  # preflights carry no key
        ok = bare.options("/v1/chat/completions", headers={"Origin": ORIGIN, **preflight})
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in ok.headers["access-control-allow-methods"]
        assert "authorization" in ok.headers["access-control-allow-headers"].lower()
        bad = bare.options(
            "/v1/chat/completions", headers={"Origin": "http://evil.example", **preflight}
        )
        assert bad.status_code == 400
        assert "access-control-allow-origin" not in bad.headers
    with httpx.Client(base_url=ops.url, headers=AUTH, timeout=30) as client:
        simple = client.get("/v1/models", headers={"Origin": ORIGIN})
        assert simple.headers["access-control-allow-origin"] == ORIGIN
        assert "x-request-id" in simple.headers["access-control-expose-headers"]
        other = client.get("/v1/models", headers={"Origin": "http://evil.example"})
        assert other.status_code == 200 and "access-control-allow-origin" not in other.headers


# -- media ---------------------------------------------------------------------------------------
def test_models_report_their_modalities(http: httpx.Client, model: str) -> None:
    (card,) = http.get("/v1/models").json()["data"]
    assert card["modalities"] == {"input": ["text"], "output": ["text"]}
    assert http.get(f"/v1/models/{model}").json()["modalities"] == card["modalities"]


def test_an_allowed_image_reaches_the_modality_check(
    ops: Ops, model: str, http: httpx.Client
) -> None:
    url = f"file://{ops.media}/cat-7781.png"
    with (
        openai.OpenAI(
            base_url=ops.url + "/v1",
            api_key=KEYS[0],
            max_retries=0,
            _strict_response_validation=True,
        ) as client,
        pytest.raises(openai.BadRequestError) as info,
    ):
        client.chat.completions.create(
            model=model,
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": url}},
                    ],
                }
            ],
        )
    assert info.value.status_code == 400
    assert info.value.code == "unsupported_modality"
    assert info.value.param == "messages.0.content.1"
    assert info.value.message.endswith(
        f"messages.0.content.1: the model {model!r} does not accept image input; it accepts text"
    )


def test_a_text_model_refuses_corrupt_media_before_decoding_and_stays_healthy(
    ops: Ops, model: str, http: httpx.Client
) -> None:
    """Media a decoder would refuse (a corrupt PNG, a decompression bomb, a ZIP called PNG)
    gets the modality 400 from a text model: nothing is decoded for it."""
    from tests.media.corpus import png

    (ops.media / "zip-7781.png").write_bytes(b"PK\x03\x04" + b"\x00" * 60)
    bomb = "data:image/png;base64," + base64.b64encode(png(100_000, 100_000)).decode()
    corrupt = f"file://{ops.media}/cat-7781.png"  # the PNG signature over zeros
    for url in (corrupt, bomb, f"file://{ops.media}/zip-7781.png"):
        resp = http.post("/v1/chat/completions", json=_media(image_part(url)))
        assert resp.status_code == 400, url[:60]
        error = openai_error(resp)
        assert (error["code"], error["param"]) == ("unsupported_modality", "messages.0.content.1")
    block = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": bomb.split(",", 1)[1]},
    }
    resp = http.post(
        "/v1/messages",
        json={"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": [block]}]},
        headers={"anthropic-version": "2023-06-01"},
    )
    assert resp.status_code == 400
    assert "does not accept image input" in resp.json()["error"]["message"]
    assert http.get("/health").json() == {"status": "ok"}
    ok = http.post("/v1/chat/completions", json=chat("Say hi."))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    log = ops.server.log.read_text()
    assert "at most 2 images, 1 audio clips, 1 videos, 4096 bytes each" in log
    assert "decoding   images up to 1000000 pixels; video up to 600 s and 18000 frames; " in log
    assert "audio up to 30 s at 192000 Hz" in log


# -- the table of hostile requests ---------------------------------------------------------------
@dataclass(frozen=True)
class Hostile:
    name: str
    status: int
    message: str  # a fragment of the error message
    envelope: str = "openai"  # "openai" | "anthropic" | "plain"
    method: str = "POST"
    path: str = "/v1/chat/completions"
    headers: tuple[tuple[str, str], ...] = (("Authorization", f"Bearer {KEYS[0]}"),)
    body: Any = None  # JSON body; a callable gets the Ops fixture
    raw: bytes | None = None
    param: str | None = None
    code: str | None = None


NO_KEY: tuple[tuple[str, str], ...] = ()
ANTHROPIC = (("anthropic-version", "2023-06-01"),)


def _media(*parts: dict[str, Any]) -> Any:
    return chat([{"type": "text", "text": "look"}, *parts])


HOSTILE = [
    # authentication
    Hostile("no key", 401, "requires an API key", headers=NO_KEY, code="invalid_api_key"),
    Hostile(
        "wrong bearer", 401, "not valid for this server", headers=(("Authorization", "Bearer x"),)
    ),
    Hostile("empty bearer", 401, "requires an API key", headers=(("Authorization", "Bearer"),)),
    Hostile(
        "basic auth", 401, "requires an API key", headers=(("Authorization", "Basic a2V5LW9uZQ=="),)
    ),
    Hostile("key prefix", 401, "not valid", headers=(("Authorization", f"Bearer {KEYS[0][:-1]}"),)),
    Hostile("key suffix", 401, "not valid", headers=(("x-api-key", KEYS[0] + "x"),)),
    Hostile(
        "key in query",
        401,
        "requires an API key",
        path="/v1/models?api_key=key-one",
        method="GET",
        headers=NO_KEY,
    ),
    Hostile(
        "wrong key, anthropic caller",
        401,
        "not valid for this server",
        envelope="anthropic",
        path="/v1/messages",
        headers=(("x-api-key", "nope"), *ANTHROPIC),
    ),
    Hostile(
        "no key on the anthropic route",
        401,
        "requires an API key",
        envelope="anthropic",
        path="/v1/messages",
        headers=NO_KEY,
    ),
    # size limits
    Hostile(
        "body over the limit",
        413,
        "larger than this server's limit of 65536 bytes",
        raw=b"x" * (MAX_BODY + 1),
        code="request_too_large",
    ),
    Hostile(
        "body over the limit, anthropic caller",
        413,
        "--max-body-bytes",
        envelope="anthropic",
        path="/v1/messages",
        raw=b"x" * (MAX_BODY + 1),
        headers=(*ANTHROPIC, *AUTH.items()),
    ),
    Hostile(
        "huge header",
        431,
        "larger than this server's limit of 8192 bytes",
        method="GET",
        path="/v1/models",
        headers=(*AUTH.items(), ("x-junk", "j" * MAX_HEADER)),
    ),
    # media URL policy
    Hostile(
        "file outside the roots",
        400,
        "the file is outside the allowed media roots",
        body=_media(image_part("file:///etc/passwd")),
        param="messages.0.content.1.image_url.url",
        code="media_url_refused",
    ),
    Hostile(
        "dot-dot traversal",
        400,
        "must not contain '..'",
        body=lambda o: _media(image_part(f"file://{o.media}/../secret.txt")),
    ),
    Hostile(
        "encoded traversal",
        400,
        "must not contain '..'",
        body=lambda o: _media(image_part(f"file://{o.media}/%2e%2e/secret.txt")),
    ),
    Hostile(
        "symlink escape",
        400,
        "leaves the allowed media roots through a symlink",
        body=lambda o: _media(image_part(f"file://{o.media}/escape.png")),
    ),
    Hostile(
        "file URL with a host",
        400,
        "must not name a host",
        body=_media(image_part("file://attacker.example/share/x.png")),
    ),
    Hostile(
        "missing file",
        400,
        "no such file under the allowed media roots",
        body=lambda o: _media(image_part(f"file://{o.media}/nope.png")),
    ),
    Hostile(
        "data URL over the cap",
        400,
        "larger than 4096 bytes (--max-media-bytes)",
        body=_media(image_part("data:image/png;base64," + base64.b64encode(b"x" * 5000).decode())),
    ),
    Hostile(
        "data URL not base64",
        400,
        "not valid base64",
        body=_media(image_part("data:image/png;base64,%%%%")),
    ),
    Hostile(
        "data URL of the wrong type",
        400,
        "'text/html' is not image media",
        body=_media(image_part("data:text/html;base64,PGgxPg==")),
    ),
    Hostile(
        "remote URL while remote media is off",
        400,
        "start it with --allow-remote-media",
        body=_media(image_part("http://169.254.169.254/latest/meta-data/")),
    ),
    Hostile(
        "gopher URL",
        400,
        "URL scheme 'gopher' is not supported",
        body=_media(image_part("gopher://example.com/1")),
    ),
    Hostile(
        "too many images",
        400,
        "carries 3 images; this server accepts at most 2",
        body=_media(*[image_part("data:image/png;base64,iVBORw0K")] * 3),
        param="messages",
        code="too_many_images",
    ),
    Hostile(
        "too many audio clips",
        400,
        "carries 2 audio clips; this server accepts at most 1 per request (--max-num-audios)",
        body=_media(
            *[{"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}] * 2
        ),
        param="messages",
        code="too_many_audios",
    ),
    Hostile(
        "too many videos",
        400,
        "carries 2 videos; this server accepts at most 1 per request (--max-num-videos)",
        body=_media(
            *[{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}] * 2
        ),
        param="messages",
        code="too_many_videos",
    ),
    Hostile(
        "audio for a text model",
        400,
        "does not accept audio input; it accepts text",
        body=_media({"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,UklGRg=="}}),
        param="messages.0.content.1",
        code="unsupported_modality",
    ),
    Hostile(
        "input_audio in an unknown format",
        400,
        "input_audio.format must be one of",
        body=_media({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "exe"}}),
    ),
    Hostile(
        "file id of no file",
        404,
        "no file 'file-abc'",
        body=_media({"type": "file", "file": {"file_id": "file-abc"}}),
    ),
    Hostile(
        "media part without a URL",
        400,
        "must be a non-empty URL string",
        body=_media({"type": "image_url", "image_url": {"detail": "high"}}),
    ),
    # routing, with a valid key
    Hostile("strange method", 405, "method BREW is not allowed", method="BREW", path="/v1/models"),
    Hostile("unknown route", 404, "no route GET /admin/secret", method="GET", path="/admin/secret"),
    Hostile(
        "CORS preflight from another origin",
        400,
        "Disallowed CORS origin",
        envelope="plain",
        method="OPTIONS",
        headers=(
            ("Origin", "http://evil.example"),
            ("Access-Control-Request-Method", "POST"),
        ),
    ),
]


@pytest.mark.parametrize("case", HOSTILE, ids=[h.name for h in HOSTILE])
def test_hostile_requests_get_clear_answers(ops: Ops, case: Hostile) -> None:
    body = case.body(ops) if callable(case.body) else case.body
    content = case.raw if case.raw is not None else (None if body is None else json.dumps(body))
    headers = dict(case.headers)
    if content is not None:
        headers.setdefault("content-type", "application/json")
    with httpx.Client(base_url=ops.url, timeout=60) as client:
        resp = client.request(case.method, case.path, content=content, headers=headers)
    assert resp.status_code == case.status, resp.text
    assert "x-request-id" in resp.headers
    if case.envelope == "plain":
        assert case.message in resp.text
        return
    err = anthropic_error(resp) if case.envelope == "anthropic" else openai_error(resp)
    assert case.message in err["message"]
    if case.envelope == "openai":
        if case.param is not None:
            assert err["param"] == case.param
            assert err["message"].startswith(case.param + ":")
        if case.code is not None:
            assert err["code"] == case.code


# -- metrics and the access log ----------------------------------------------------------------
def test_a_chat_is_counted_timed_and_logged_without_its_prompt(
    ops: Ops, http: httpx.Client, model: str
) -> None:
    before = scrape(http)
    body = chat(f"Say hello to {PROMPT_MARKER}.", max_tokens=6, temperature=0, ignore_eos=True)
    resp = http.post("/v1/chat/completions", json=body, headers={"x-request-id": "ops-chat-1"})
    assert resp.status_code == 200
    usage = resp.json()["usage"]
    streamed = http.post(
        "/v1/chat/completions",
        json={**body, "stream": True},
        headers={"x-request-id": "ops-stream-1"},
    )
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    after = scrape(http)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    route = 'route="/v1/chat/completions"'
    assert delta(f'inferd_http_requests_total{{method="POST",{route},status="200"}}') == 2
    assert delta(f'inferd_http_request_outcomes_total{{outcome="complete",{route}}}') == 2
    assert delta(f'inferd_http_request_duration_seconds_count{{method="POST",{route}}}') == 2
    assert delta(f'inferd_http_request_body_bytes_count{{method="POST",{route}}}') == 2
    assert delta(f'inferd_http_request_body_bytes_sum{{method="POST",{route}}}') > 0
    m = f'model="{model}"'
    assert delta(f"inferd_time_to_first_token_seconds_count{{{m}}}") == 2
    assert delta(f'inferd_time_to_first_token_seconds_bucket{{le="+Inf",{m}}}') == 2
    assert 0 < delta(f"inferd_inter_token_latency_seconds_count{{{m}}}") <= 2 * (6 - 1)
    assert delta(f"inferd_request_generation_tokens_total{{{m}}}") == 12
    assert delta(f"inferd_request_prompt_tokens_total{{{m}}}") == 2 * usage["prompt_tokens"]
    assert after["inferd_http_requests_in_flight"] >= 1  # the scrape itself
    for gauge in (
        "inferd_requests_running",
        "inferd_requests_waiting",
        "inferd_kv_blocks_used",
        "inferd_kv_blocks_total",
        "inferd_prefix_cache_hits_total",
    ):
        assert f"{gauge}{{{m}}}" in after
    assert after[f"inferd_kv_blocks_total{{{m}}}"] > 0

    end = wait_for_end(ops, "ops-chat-1")
    assert end == {
        "ts": end["ts"],
        "event": "request_end",
        "request_id": "ops-chat-1",
        "method": "POST",
        "route": "/v1/chat/completions",
        "status": 200,
        "duration_ms": end["duration_ms"],
        "model": model,
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "outcome": "complete",
    }
    assert end["duration_ms"] > 0
    starts = [e for e in access_lines(ops) if e["event"] == "request_start"]
    assert {
        "request_id": "ops-chat-1",
        "method": "POST",
        "route": "/v1/chat/completions",
    }.items() <= next(e for e in starts if e["request_id"] == "ops-chat-1").items()
    assert wait_for_end(ops, "ops-stream-1")["completion_tokens"] == 6

    log = ops.server.log.read_text()
    assert PROMPT_MARKER not in log  # prompts never reach the log ...
    payloads = [json.loads(line) for line in ops.payloads.read_text().splitlines()]
    recorded = [p for p in payloads if p["request_id"] == "ops-chat-1"]
    assert len(recorded) == 1 and PROMPT_MARKER in recorded[0]["body"]  # ... only --log-payloads
    assert recorded[0]["route"] == "/v1/chat/completions" and not recorded[0]["truncated"]
    assert (ops.payloads.stat().st_mode & 0o777) == 0o600
    assert "--log-payloads: request bodies" in log  # the startup warning


def test_media_paths_and_raw_paths_stay_out_of_logs_and_metrics(
    ops: Ops, http: httpx.Client
) -> None:
    resp = http.post(
        "/v1/chat/completions",
        json=_media(image_part(f"file://{ops.media}/cat-7781.png")),
        headers={"x-request-id": "ops-media-1"},
    )
    assert resp.status_code == 400
    assert http.get("/v1/models/private-name-3141").status_code == 404
    assert http.get("/secret/path/qz-2718").status_code == 404
    assert wait_for_end(ops, "ops-media-1")["outcome"] == "error"
    samples = scrape(http)
    text = "\n".join(samples)
    for leaked in ("cat-7781", "private-name-3141", "/secret/path", "qz-2718", str(ops.media)):
        assert leaked not in text
    log = "\n".join(json.dumps(e) for e in access_lines(ops))
    for leaked in ("cat-7781", "private-name-3141", "qz-2718", str(ops.media)):
        assert leaked not in log
    assert samples['inferd_http_requests_total{method="GET",route="<unmatched>",status="404"}'] >= 1
    model_route = 'route="/v1/models/{model_id:path}"'
    assert samples[f'inferd_http_requests_total{{method="GET",{model_route},status="404"}}'] >= 1
    assert any('method="OTHER"' in name for name in samples)  # the BREW request of the table


def test_a_client_that_leaves_mid_stream_is_logged_as_disconnected(
    ops: Ops, http: httpx.Client
) -> None:
    body = chat("Write a very long story about the sea.", max_tokens=400, ignore_eos=True)
    headers = {**AUTH, "x-request-id": "ops-leaver-1"}
    with (
        httpx.Client(base_url=ops.url, timeout=120) as client,
        client.stream(
            "POST", "/v1/chat/completions", json={**body, "stream": True}, headers=headers
        ) as resp,
    ):
        for line in resp.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break  # one real token arrived; hang up
    end = wait_for_end(ops, "ops-leaver-1")
    assert end["status"] == 200 and end["outcome"] == "client_disconnected"
    assert 0 < (end["completion_tokens"] or 0) < 400
    # known from the first output, so a run cut short is billed its prompt too
    assert end["prompt_tokens"] == _prompt_tokens(http, body)
    samples = scrape(http)
    outcome = 'outcome="client_disconnected"'
    assert samples[f"inferd_http_request_outcomes_total{{{outcome},{ROUTE}}}"] >= 1


def test_openapi_and_docs(http: httpx.Client) -> None:
    doc = http.get("/openapi.json").json()
    post = doc["paths"]["/v1/chat/completions"]["post"]
    ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert ref == "#/components/schemas/ChatCompletionRequest"
    schema = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert "messages" in schema["properties"]
    assert doc["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    assert doc["paths"]["/health"]["get"]["security"] == []
    assert "/metrics" not in doc["paths"]
    assert http.get("/docs").status_code == 404  # its page loads JavaScript from a CDN


def test_the_server_is_healthy_and_holds_no_kv_blocks_afterwards(
    http: httpx.Client, model: str
) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    deadline = time.monotonic() + 30  # a leaked request would hold its blocks far longer
    while True:
        samples = scrape(http)
        if samples[f'inferd_kv_blocks_used{{model="{model}"}}'] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert samples[f'inferd_kv_blocks_used{{model="{model}"}}'] == 0
    assert samples[f'inferd_requests_running{{model="{model}"}}'] == 0
    ok = http.post("/v1/chat/completions", json=chat("hi", temperature=0))
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"
    assert re.fullmatch(r"[0-9a-f]{32}", ok.headers["x-request-id"])
