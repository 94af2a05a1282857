"""Hostile pages and hostile connections against a real `inferd serve` on loopback.

- Cross-site requests: a page can POST "simple" requests (text/plain, forms, no content type)
  without a preflight, and through DNS rebinding read the answers. JSON routes answer 415 to
  any content type but JSON, before reading the body; a Host that is not this server's gets
  421 before routing; the lifecycle routes take only the admin key once one is set.
- Slow clients: idle connections, heads and bodies sent halfway or a byte at a time are cut
  after the head / body timeouts (3 s here, so the module runs in seconds); past
  --max-connections a request gets 503.

Every refusal is checked for its status, its envelope (OpenAI's, or Anthropic's for Anthropic
callers) and its x-request-id, and every test ends with the server healthy, nothing running and
no KV blocks held.
"""

from __future__ import annotations

import asyncio
import json
import re
import select
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from inferd.cli import _parser, main
from inferd.server.app import build_app
from inferd.server.crosssite import HostAllowList, is_json
from inferd.server.options import ServerOptions
from inferd.server.serve_args import describe, server_options
from tests.server.live import LiveServer, live_server

ADMIN_KEY = "admin-key-7731"
TIMEOUT = 3  # --header-timeout and --body-timeout of the module's server
MAX_CONNECTIONS = 64
ANTHROPIC = {"anthropic-version": "2023-06-01"}
REQUEST_ID = re.compile(r"[0-9a-f]{32}")


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("hostile-transport")
    args = [
        *("-m", str(smollm2_gguf), "--dtype", "f32", "--max-seqs", "4", "--max-seq-len", "1024"),
        *("--admin-key", ADMIN_KEY, "--allowed-hosts", "inferd.lan"),
        *("--header-timeout", str(TIMEOUT), "--body-timeout", str(TIMEOUT)),
        *("--max-connections", str(MAX_CONNECTIONS)),
    ]
    with live_server(args, tmp / "serve.log") as live:
        yield live


@pytest.fixture(scope="module")
def model(server: LiveServer) -> str:
    return str(httpx.get(server.api + "/models", timeout=30).json()["data"][0]["id"])


def port_of(server: LiveServer) -> int:
    return int(server.url.rsplit(":", 1)[1])


def openai_error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert REQUEST_ID.fullmatch(resp.headers["x-request-id"])
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return dict(body["error"])


def anthropic_error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert REQUEST_ID.fullmatch(resp.headers["x-request-id"])
    body = resp.json()
    assert body["type"] == "error" and set(body) == {"type", "error", "request_id"}
    assert body["request_id"] == resp.headers["x-request-id"]
    assert set(body["error"]) == {"type", "message"}
    return dict(body["error"])


def assert_healthy(server: LiveServer, model: str) -> None:
    """/health answers, and once running requests have ended no KV block is held."""
    assert httpx.get(server.url + "/health", timeout=30).json() == {"status": "ok"}
    deadline = time.monotonic() + 60  # a leaked request would hold its blocks for good
    while server.metric("inferd_kv_blocks_used") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.metric("inferd_kv_blocks_used") == 0
    assert server.metric("inferd_requests_running") == 0
    status = _lifecycle(server, "status", model)
    assert status.status_code == 200 and status.json()["status"] == "loaded"


def _lifecycle(server: LiveServer, action: str, model: str, **headers: str) -> httpx.Response:
    auth = {"Authorization": f"Bearer {ADMIN_KEY}", **headers}
    return httpx.post(
        f"{server.api}/models/{action}", json={"model_id": model}, headers=auth, timeout=60
    )


def chat(**extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


# -- content type --------------------------------------------------------------------------------
SIMPLE_REQUESTS = [  # what a page may send cross-site with no preflight
    ("text/plain", "'text/plain'"),
    ("text/plain;charset=UTF-8", "'text/plain;charset=UTF-8'"),
    ("application/x-www-form-urlencoded", "'application/x-www-form-urlencoded'"),
    ("multipart/form-data; boundary=x", "'multipart/form-data; boundary=x'"),
    (None, "none"),
]


@pytest.mark.parametrize(("content_type", "shown"), SIMPLE_REQUESTS)
def test_simple_cross_site_posts_get_415_and_change_nothing(
    server: LiveServer, model: str, content_type: str | None, shown: str
) -> None:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}  # past the admin guard, to the 415
    if content_type is not None:
        headers["content-type"] = content_type
    body = json.dumps({"model_id": model}).encode()
    for route in ("/v1/models/unload", "/v1/chat/completions", "/v1/tokenize", "/completions"):
        resp = httpx.post(server.url + route, content=body, headers=headers, timeout=30)
        err = openai_error(resp, 415)
        assert err["code"] == "unsupported_media_type"
        assert err["message"] == (
            f"this route takes a JSON body: send 'Content-Type: application/json' (got {shown})"
        )
    resp = httpx.post(
        server.api + "/messages", content=body, headers=headers | ANTHROPIC, timeout=30
    )
    assert anthropic_error(resp, 415)["type"] == "invalid_request_error"
    assert_healthy(server, model)  # the unload above never ran: the model is still loaded


@pytest.mark.parametrize(
    "content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON"]
)
def test_json_with_or_without_parameters_is_accepted(
    server: LiveServer, model: str, content_type: str
) -> None:
    body = json.dumps(chat(temperature=0)).encode()
    resp = httpx.post(
        server.api + "/chat/completions",
        content=body,
        headers={"content-type": content_type},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["role"] == "assistant"
    assert_healthy(server, model)


def test_json_lookalikes_are_refused() -> None:
    assert is_json("application/json") and is_json(" application/json ; charset=utf-8")
    for other in ("application/jsonx", "application/json-seq", "text/json", "json", ""):
        assert not is_json(other)


# -- Host allow-list -----------------------------------------------------------------------------
def test_dns_rebinding_gets_421_before_routing(server: LiveServer, model: str) -> None:
    """After rebinding, the page is same-origin: it sends JSON with its own Host and Origin."""
    port = port_of(server)
    rebound = {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}
    for method, path in [("POST", "/v1/models/unload"), ("GET", "/v1/models"), ("GET", "/nope")]:
        resp = httpx.request(
            method, server.url + path, json={"model_id": model}, headers=rebound, timeout=30
        )
        err = openai_error(resp, 421)
        assert err["code"] == "host_not_allowed"
        assert err["message"].startswith(
            f"this server does not answer to the Host 'evil.example:{port}'"
        )
        assert "access-control-allow-origin" not in resp.headers
    resp = httpx.post(
        server.api + "/messages",
        json={},
        headers={"Host": "evil.example", **ANTHROPIC},
        timeout=30,
    )
    assert anthropic_error(resp, 421)["message"].startswith(
        "this server does not answer to the Host 'evil.example'"
    )
    assert_healthy(server, model)


def test_the_servers_own_names_are_answered(server: LiveServer, model: str) -> None:
    port = port_of(server)
    allowed = [f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}", "inferd.lan:8080"]
    for host in allowed:
        resp = httpx.get(server.api + "/models", headers={"Host": host}, timeout=30)
        assert resp.status_code == 200, (host, resp.text)
    for host in [f"localhost:{port + 1}", "127.0.0.1", f"inferd.lan.evil.example:{port}"]:
        resp = httpx.get(server.api + "/models", headers={"Host": host}, timeout=30)
        assert openai_error(resp, 421)["code"] == "host_not_allowed"
    assert_healthy(server, model)


def test_the_host_allow_list() -> None:
    lan = HostAllowList.for_server("192.168.1.5", 1234, ["box.lan", "proxy.example:8443"])
    assert lan.allows("192.168.1.5:1234") and lan.allows("[::1]:1234")
    assert lan.allows("localhost.:1234") and lan.allows("box.lan") and lan.allows("box.lan:99")
    assert lan.allows("proxy.example:8443") and not lan.allows("proxy.example:1234")
    assert not lan.allows("192.168.1.6:1234") and not lan.allows(None)
    assert not lan.allows("localhost:1235") and not lan.allows("evil.example:1234")
    wildcard = HostAllowList.for_server("0.0.0.0", 1234)
    assert wildcard.allows("10.0.0.7:1234") and wildcard.allows("[fe80::1]:1234")
    assert not wildcard.allows("10.0.0.7:80") and not wildcard.allows("evil.example:1234")
    ipv6 = HostAllowList.for_server("::1", 80)
    assert ipv6.allows("[::1]") and ipv6.allows("localhost")
    assert HostAllowList.for_server("127.0.0.1", 1, ["*"]).allows("anything.example")
    with pytest.raises(ValueError, match="must be a host name"):
        HostAllowList.for_server("127.0.0.1", 1, ["http://box.lan"])


def test_build_app_checks_hosts_only_when_given_a_list() -> None:
    """An embedder's app (here httpx's in-process client, Host 'testserver') keeps working."""

    async def get(app: Any) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as c:
            return await c.get("/health")

    assert asyncio.run(get(build_app([]))).status_code == 200
    refused = asyncio.run(
        get(build_app([], ServerOptions(allowed_hosts=HostAllowList.of(["inferd.lan"]))))
    )
    assert openai_error(refused, 421)["code"] == "host_not_allowed"


# -- admin key -----------------------------------------------------------------------------------
def test_lifecycle_routes_take_only_the_admin_key(server: LiveServer, model: str) -> None:
    body = {"model_id": model}
    for headers in ({}, {"Authorization": "Bearer not-the-key"}, {"x-api-key": "nope"}):
        resp = httpx.post(server.api + "/models/unload", json=body, headers=headers, timeout=30)
        err = openai_error(resp, 401)
        assert err["code"] == "invalid_api_key"
        assert "admin key" in err["message"]
    resp = httpx.post(server.url + "/models/reload", json=body, headers=ANTHROPIC, timeout=30)
    assert anthropic_error(resp, 401)["type"] == "authentication_error"
    ok = _lifecycle(server, "status", model, **{"x-request-id": "admin-status-1"})
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "admin-status-1"
    # the rest of the API stays open (no --api-key); the admin key is not needed there
    assert httpx.post(server.api + "/chat/completions", json=chat(), timeout=60).status_code == 200
    assert_healthy(server, model)


def _serve_options(host: str, *flags: str, env: dict[str, str] | None = None) -> ServerOptions:
    args = _parser().parse_args(["serve", "--host", host, *flags])
    return server_options(args, env or {})


def test_lifecycle_routes_are_off_on_a_public_address_without_an_admin_key() -> None:
    public = _serve_options("0.0.0.0")
    assert public.admin_routes is False
    assert "inferd  admin      lifecycle routes off (non-loopback bind, no --admin-key)" in [
        f"inferd  {line}" for line in describe(public)
    ]
    assert _serve_options("127.0.0.1").admin_routes is True
    keyed = _serve_options("0.0.0.0", env={"INFERD_ADMIN_KEYS": "k1, k2"})
    assert keyed.admin_routes is True and keyed.admin_keys == ("k1", "k2")
    assert "admin      lifecycle routes need one of 2 admin key(s)" in describe(keyed)

    async def post(path: str) -> httpx.Response:
        app = build_app([], public)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:1234") as c:
            return await c.post(path, json={"model_id": "m"})

    for path in ("/v1/models/unload", "/models/reload", "/v1/models/status"):
        err = openai_error(asyncio.run(post(path)), 404)
        assert err["message"].startswith(
            f"no route POST {path}: the model lifecycle routes are off"
        )


# -- slow clients --------------------------------------------------------------------------------
def _connect(server: LiveServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port_of(server)), timeout=60)


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes (the socket timeout bounds the wait)."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def _response(raw: bytes) -> tuple[int, dict[str, str], Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body)


def _post_head(server: LiveServer, path: str, length: int, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port_of(server)}\r\n"
        f"Content-Type: application/json\r\n{extra}Content-Length: {length}\r\n\r\n"
    ).encode()


def test_idle_and_half_sent_connections_are_cut(server: LiveServer, model: str) -> None:
    """Idle connections, heads and bodies stopped halfway, and a body trickling in all end."""
    idle = [_connect(server) for _ in range(20)]
    heads = [_connect(server) for _ in range(10)]
    for sock in heads:
        sock.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nanthropic-version: 1\r\n")
    bodies = [_connect(server) for _ in range(10)]
    for sock in bodies:
        sock.sendall(_post_head(server, "/v1/chat/completions", 1000) + b'{"messages": [')
    trickle = _connect(server)
    trickle.sendall(_post_head(server, "/v1/chat/completions", 1000, "anthropic-version: 1\r\n"))

    def drip() -> bytes:
        """A byte every half second (far below 32 KiB/s), then silence until the server answers.

        The drip stops well before the deadline: a byte landing just as the server closes
        would turn its close into a reset that discards the 408 (a race, not a server fault).
        """
        stop = time.monotonic() + TIMEOUT / 2
        while time.monotonic() < stop and not select.select([trickle], [], [], 0.5)[0]:
            trickle.sendall(b" ")
        return _read_all(trickle)

    with ExitStack() as sockets, ThreadPoolExecutor(1) as pool:
        for sock in [*idle, *heads, *bodies, trickle]:
            sockets.enter_context(sock)  # closed even when an assertion fails
        dripped = pool.submit(drip)
        assert all(_read_all(sock) == b"" for sock in idle)  # closed without a word
        for sock in heads:
            status, headers, body = _response(_read_all(sock))
            assert status == 408 and REQUEST_ID.fullmatch(headers["x-request-id"])
            assert headers["connection"] == "close"
            assert body == {
                "type": "error",
                "error": {
                    "type": "timeout_error",
                    "message": f"the request head did not arrive within {TIMEOUT}s "
                    "(--header-timeout)",
                },
                "request_id": headers["x-request-id"],
            }
        for sock in bodies:
            status, headers, body = _response(_read_all(sock))
            assert status == 408 and REQUEST_ID.fullmatch(headers["x-request-id"])
            assert headers["connection"] == "close"
            assert body["error"]["code"] == "body_timeout"
            assert body["error"]["message"].startswith(
                "the request body did not arrive in time: 14 bytes in"
            )
        status, headers, body = _response(dripped.result())
        assert status == 408 and body["type"] == "error"
        assert "the request body did not arrive in time" in body["error"]["message"]
    assert_healthy(server, model)


def test_a_slow_but_steady_upload_is_not_cut(server: LiveServer, model: str) -> None:
    """A body sent in pieces over more than the body timeout, faster than 32 KiB/s, passes."""
    body = json.dumps(chat(temperature=0) | {"user": "x" * 200_000}).encode()
    with _connect(server) as sock:
        head = _post_head(server, "/v1/chat/completions", len(body), "Connection: close\r\n")
        sock.sendall(head)
        step = len(body) // (2 * TIMEOUT + 2)
        for start in range(0, len(body), step):
            sock.sendall(body[start : start + step])
            time.sleep(0.5)
        raw = _read_all(sock)
    status, headers, answer = _response(raw)
    assert status == 200 and REQUEST_ID.fullmatch(headers["x-request-id"])
    assert answer["choices"][0]["message"]["role"] == "assistant"
    assert_healthy(server, model)


def test_connections_past_the_cap_get_503(server: LiveServer, model: str) -> None:
    held = [_connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        with _connect(server) as extra:
            extra.sendall(
                f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:{port_of(server)}\r\n"
                "anthropic-version: 2023-06-01\r\n\r\n".encode()
            )
            status, headers, body = _response(_read_all(extra))
    finally:
        for sock in held:
            sock.close()
    assert status == 503 and REQUEST_ID.fullmatch(headers["x-request-id"])
    assert headers["retry-after"] == "1" and headers["connection"] == "close"
    assert body == {
        "type": "error",
        "error": {
            "type": "overloaded_error",
            "message": f"this server is at its limit of {MAX_CONNECTIONS} open connections "
            "(--max-connections); retry shortly",
        },
        "request_id": headers["x-request-id"],
    }
    deadline = time.monotonic() + 30  # the held connections close on the server's side soon
    while (resp := httpx.get(server.api + "/models", timeout=30)).status_code == 503:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert resp.status_code == 200
    assert_healthy(server, model)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--header-timeout", "0"], "--header-timeout must be positive"),
        (["--body-timeout", "-1"], "--body-timeout must be positive"),
        (["--max-connections", "0"], "--max-connections must be at least 1"),
        (["--admin-key", "two words"], "printable ASCII without spaces"),
        (["--allowed-hosts", "http://box.lan"], "must be a host name, optionally with :port"),
    ],
)
def test_transport_flags_are_checked_before_the_model_loads(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing_model = str(tmp_path / "never-loaded.gguf")
    assert main(["serve", "-m", missing_model, *flags]) == 2
    assert message in capsys.readouterr().err


def test_admin_and_api_keys_open_only_their_own_routes() -> None:
    app = build_app(
        [],
        ServerOptions(api_keys=("api-key-1",), admin_keys=(ADMIN_KEY,), access_log_format=None),
    )

    async def call(method: str, path: str, key: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        headers = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            return await c.request(method, path, json={"model_id": "m"}, headers=headers)

    def run(method: str, path: str, key: str) -> httpx.Response:
        return asyncio.run(call(method, path, key))

    refused = openai_error(run("POST", "/v1/models/status", "api-key-1"), 401)
    assert refused["message"] == "the admin key is not valid for this server"
    passed = openai_error(run("POST", "/v1/models/status", ADMIN_KEY), 404)  # no model "m"
    assert passed["code"] == "model_not_found"
    refused = openai_error(run("GET", "/v1/models", ADMIN_KEY), 401)
    assert refused["message"] == "the API key is not valid for this server"
    assert run("GET", "/v1/models", "api-key-1").status_code == 200
