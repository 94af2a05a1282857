"""Media URL policy and the remote fetcher, tested on the real filesystem and real sockets.

Every socket here is on 127.0.0.1. Refusals of other addresses (private, metadata, ...) are
decided before any connection is attempted, which the tests check by counting connections.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from inferd.server.errors import APIError
from inferd.server.media import (
    MediaPolicy,
    Modalities,
    check_media_parts,
    load_media,
    model_modalities,
    read_media_file,
)
from inferd.server.media_fetch import (
    FetchError,
    FetchPolicy,
    address_refusal,
    check_remote_url,
    fetch,
)

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 56


@dataclass(frozen=True)
class Card:
    """What check_media_parts reads of a served model: its id and declared modalities."""

    id: str
    modalities: Modalities = field(default_factory=Modalities)


TEXT_MODEL = Card("smollm2")
VISION_MODEL = Card("vision", Modalities(("text", "image", "audio", "video", "file")))


def image(url: str) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]


def refusal(messages: list[dict[str, Any]], policy: MediaPolicy, model: Card = VISION_MODEL) -> str:
    with pytest.raises(APIError) as info:
        check_media_parts(messages, policy, model)
    err = info.value
    assert err.status == 400
    assert err.param is not None and err.message.startswith(err.param)
    return err.message


def data_url(payload: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(payload).decode()}"


# -- filesystem --------------------------------------------------------------------------------
@pytest.fixture
def tree(tmp_path: Path) -> Iterator[dict[str, Path]]:
    """media/ (the root) holding a picture, a sibling media2/, and a secret outside both."""
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "cat.png").write_bytes(PNG)
    (root / "sub" / "dog.png").write_bytes(PNG)
    (tmp_path / "media2").mkdir()
    (tmp_path / "media2" / "other.png").write_bytes(PNG)
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret")
    (root / "escape.png").symlink_to(secret)
    (root / "dirlink").symlink_to(tmp_path)
    (root / "inside.png").symlink_to(root / "sub" / "dog.png")
    yield {"root": root, "secret": secret, "tmp": tmp_path}


def policy_for(tree: dict[str, Path], **kw: Any) -> MediaPolicy:
    return MediaPolicy.create(media_roots=[tree["root"]], **kw)


def test_a_file_under_the_root_passes_and_loads(tree: dict[str, Path]) -> None:
    policy = policy_for(tree)
    for name in ("cat.png", "sub/dog.png", "inside.png", "sub//dog.png", "./cat.png"):
        (ref,) = check_media_parts(image(f"file://{tree['root']}/{name}"), policy, VISION_MODEL)
        assert ref.source == "file" and ref.modality == "image"
        assert ref.param == "messages.0.content.1.image_url.url"
        assert asyncio.run(load_media(ref, policy)) == PNG
    (ref,) = check_media_parts(
        image(f"file://localhost{tree['root']}/cat.png"), policy, VISION_MODEL
    )
    assert ref.path == tree["root"] / "cat.png"


@pytest.mark.parametrize(
    ("suffix", "reason"),
    [
        ("/../secret.txt", "must not contain '..'"),
        ("/sub/../../secret.txt", "must not contain '..'"),
        ("/%2e%2e/secret.txt", "must not contain '..'"),
        ("/%2E%2E/secret.txt", "must not contain '..'"),
        ("/escape.png", "leaves the allowed media roots through a symlink"),
        ("/dirlink/secret.txt", "leaves the allowed media roots through a symlink"),
        ("/missing.png", "no such file under the allowed media roots"),
        ("/sub", "not a regular file"),
        ("/cat.png?x=1", "must not have a query or fragment"),
        ("/cat.png#frag", "must not have a query or fragment"),
        ("/cat%00.png", "NUL byte"),
        ("/%ff.png", "not valid UTF-8"),
    ],
)
def test_file_urls_that_escape_or_miss_are_refused(
    tree: dict[str, Path], suffix: str, reason: str
) -> None:
    message = refusal(image(f"file://{tree['root']}{suffix}"), policy_for(tree))
    assert reason in message


def test_files_outside_the_roots_get_the_same_answer_whether_or_not_they_exist(
    tree: dict[str, Path],
) -> None:
    policy = policy_for(tree)
    for path in (
        tree["secret"],
        tree["tmp"] / "nope",
        "/etc/passwd",
        tree["tmp"] / "media2/other.png",
    ):
        message = refusal(image(f"file://{path}"), policy)
        assert message.endswith("the file is outside the allowed media roots")


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("file://evil.example/etc/passwd", "must not name a host"),
        ("file:relative/cat.png", "must hold an absolute path"),
        ("file:", "must hold an absolute path"),
    ],
)
def test_malformed_file_urls(tree: dict[str, Path], url: str, reason: str) -> None:
    assert reason in refusal(image(url), policy_for(tree))


def test_file_urls_are_refused_without_roots_and_over_the_size_cap(tree: dict[str, Path]) -> None:
    url = f"file://{tree['root']}/cat.png"
    assert "start it with --allowed-media-root" in refusal(image(url), MediaPolicy())
    small = policy_for(tree, max_media_bytes=10)
    assert "larger than 10 bytes (--max-media-bytes)" in refusal(image(url), small)


def test_reading_refuses_a_file_swapped_for_a_symlink_after_the_check(
    tree: dict[str, Path],
) -> None:
    policy = policy_for(tree)
    victim = tree["root"] / "swap.png"
    victim.write_bytes(PNG)
    (ref,) = check_media_parts(image(f"file://{victim}"), policy, VISION_MODEL)
    victim.unlink()
    victim.symlink_to(tree["secret"])
    assert ref.path is not None
    with pytest.raises(FetchError, match="cannot be opened"):
        read_media_file(ref.path, policy)
    with pytest.raises(APIError, match="cannot be opened"):
        asyncio.run(load_media(ref, policy))


def test_roots_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not an existing directory"):
        MediaPolicy.create(media_roots=[tmp_path / "absent"])
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="not an existing directory"):
        MediaPolicy.create(media_roots=[tmp_path / "f"])


def test_a_root_given_through_a_symlink_works(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (real / "a.png").write_bytes(PNG)
    (tmp_path / "alias").symlink_to(real)
    policy = MediaPolicy.create(media_roots=[tmp_path / "alias"])
    for url in (f"file://{tmp_path}/alias/a.png", f"file://{real}/a.png"):
        (ref,) = check_media_parts(image(url), policy, VISION_MODEL)
        assert ref.path == real / "a.png"


# -- data URLs and inline data ---------------------------------------------------------------
def test_data_urls_decode_under_the_cap() -> None:
    policy = MediaPolicy.create(max_media_bytes=len(PNG))
    (ref,) = check_media_parts(image(data_url(PNG)), policy, VISION_MODEL)
    assert ref.source == "data" and ref.data == PNG and ref.media_type == "image/png"
    (ref,) = check_media_parts(image("data:image/png,%89PNG"), policy, VISION_MODEL)
    assert ref.data == b"\x89PNG"


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        (data_url(PNG + b"x"), "larger than 64 bytes (--max-media-bytes)"),
        ("data:image/png;base64," + "A" * 10_000_000, "larger than 64 bytes"),
        ("data:image/png," + "%41" * 65, "larger than 64 bytes"),
        ("data:image/png;base64,@@@@", "not valid base64"),
        ("data:image/png;base64,QUJD\nRA==", "not valid base64"),
        ("data:image/png;base64", "no ',' before the data"),
        ("data:image/png;base64,", "must be a non-empty base64 string"),
        ("data:image/png,", "holds no data"),
        (data_url(PNG, "text/html"), "'text/html' is not image media"),
        (data_url(PNG, "nonsense"), "'nonsense' is not a media type"),
        ("data:" + "x" * 300 + ",AAAA", "media type is too long"),
    ],
)
def test_bad_data_urls(url: str, reason: str) -> None:
    assert reason in refusal(image(url), MediaPolicy.create(max_media_bytes=len(PNG)))


def test_input_audio_file_and_anthropic_blocks() -> None:
    policy = MediaPolicy()
    wav = base64.b64encode(b"RIFF....WAVE").decode()
    parts = [
        {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},
        {"type": "audio_url", "audio_url": {"url": data_url(b"RIFF", "audio/wav")}},
        {"type": "video_url", "video_url": {"url": data_url(b"\x00\x00", "video/mp4")}},
        {"type": "file", "file": {"file_data": data_url(b"%PDF-1.7", "application/pdf")}},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": wav}},
    ]
    refs = check_media_parts([{"role": "user", "content": parts}], policy, VISION_MODEL)
    assert [r.modality for r in refs] == ["audio", "audio", "video", "file", "image"]
    assert refs[0].data == b"RIFF....WAVE" and refs[0].media_type == "audio/wav"

    def one(part: dict[str, Any]) -> str:
        return refusal([{"role": "user", "content": [part]}], policy)

    bad_format = {"type": "input_audio", "input_audio": {"data": wav, "format": "exe"}}
    assert "messages.0.content.0.input_audio.format must be one of" in one(bad_format)
    assert "must be an object" in one({"type": "input_audio", "input_audio": "x"})
    assert "a file id is not read here" in one({"type": "file", "file": {"file_id": "file-1"}})
    url_block = {"type": "image", "source": {"type": "url", "url": "http://example.com/a.png"}}
    assert "--allow-remote-media" in one(url_block)
    assert "'file' is not supported" in one({"type": "image", "source": {"type": "file"}})


def test_images_over_the_count_cap_are_refused_before_anything_else() -> None:
    policy = MediaPolicy.create(max_num_images=2)
    parts = [{"type": "image_url", "image_url": {"url": "gopher://x"}} for _ in range(3)]
    with pytest.raises(APIError) as info:
        check_media_parts([{"role": "user", "content": parts}], policy, VISION_MODEL)
    assert info.value.code == "too_many_images" and info.value.param == "messages"
    assert "carries 3 images; this server accepts at most 2" in info.value.message


# -- schemes and remote URLs -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://example.com/cat.png", "not allowed on this server (start it with --allow-remote"),
        ("https://example.com/cat.png", "not allowed on this server (start it with --allow-remote"),
        ("ftp://example.com/cat.png", "URL scheme 'ftp' is not supported"),
        ("gopher://example.com/", "URL scheme 'gopher' is not supported"),
        ("javascript:alert(1)", "URL scheme 'javascript' is not supported"),
        ("/etc/passwd", "a URL without a scheme is not supported"),
        ("cat.png", "a URL without a scheme is not supported"),
    ],
)
def test_schemes_refused_by_default(url: str, reason: str) -> None:
    assert reason in refusal(image(url), MediaPolicy())


def test_non_string_urls() -> None:
    for value in (None, 5, "", {"nope": 1}):
        msg = refusal(
            [{"role": "user", "content": [{"type": "image_url", "image_url": value}]}],
            MediaPolicy(),
        )
        assert "must be a non-empty URL string" in msg


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        (
            "http://example.com:8080/a.png",
            "port 8080 is not allowed for remote media (allowed: 80, 443)",
        ),
        ("https://example.com:22/a.png", "port 22 is not allowed"),
        ("http://user:pw@example.com/a.png", "must not carry credentials"),
        ("http://example.com:99999/a.png", "malformed"),
        ("http:///a.png", "has no host"),
        ("http://127.0.0.1/a.png", "loopback"),
        ("http://[::1]/a.png", "loopback"),
        ("http://10.0.0.8/a.png", "private"),
        ("http://192.168.1.1/a.png", "private"),
        ("http://169.254.169.254/latest/meta-data/", "cloud metadata"),
        ("http://[fd00:ec2::254]/", "cloud metadata"),
        ("http://[::ffff:127.0.0.1]/", "loopback"),
        ("http://0.0.0.0/", "unspecified"),
        ("http://2130706433/", "written as a number"),
        ("http://0x7f.0.0.1/", "written as a number"),
        ("http://017.0.0.1/", "written as a number"),
        ("http://exa mple.com/", "whitespace or control"),
    ],
)
def test_remote_urls_static_checks(url: str, reason: str) -> None:
    policy = MediaPolicy.create(allow_remote=True)
    assert reason in refusal(image(url), policy)


def test_remote_urls_pass_the_static_checks_when_allowed() -> None:
    policy = MediaPolicy.create(allow_remote=True)
    for url in ("https://example.com/a.png", "http://example.com:80/a.png", "https://8.8.8.8/x"):
        (ref,) = check_media_parts(image(url), policy, VISION_MODEL)
        assert ref.source == "remote" and ref.url == url
    custom = MediaPolicy.create(allow_remote=True, remote_ports=[8443])
    check_media_parts(image("https://example.com:8443/a.png"), custom, VISION_MODEL)
    assert "port 443 is not allowed" in refusal(image("https://example.com/a.png"), custom)


# -- modalities --------------------------------------------------------------------------------
def test_policy_runs_before_the_modality_check(tree: dict[str, Path]) -> None:
    policy = policy_for(tree)
    outside = refusal(image(f"file://{tree['secret']}"), policy, TEXT_MODEL)
    assert "outside the allowed media roots" in outside
    with pytest.raises(APIError) as info:
        check_media_parts(image(f"file://{tree['root']}/cat.png"), policy, TEXT_MODEL)
    err = info.value
    assert err.status == 400 and err.code == "unsupported_modality"
    assert err.param == "messages.0.content.1"
    assert err.message == (
        "messages.0.content.1: the model 'smollm2' does not accept image input; it accepts text"
    )


def test_model_modalities() -> None:
    assert model_modalities(object()).card() == {"input": ["text"], "output": ["text"]}
    assert model_modalities(VISION_MODEL).input[1] == "image"
    declared = Card("x", {"input": ["text", "audio"]})  # type: ignore[arg-type]
    assert model_modalities(declared).card() == {"input": ["text", "audio"], "output": ["text"]}


def test_text_only_messages_and_pydantic_messages_pass() -> None:
    from inferd.server.protocol import ChatMessage

    msgs = [
        ChatMessage(role="user", content=[{"type": "text", "text": "hi"}]),
        {"role": "user", "content": "x"},
    ]
    assert check_media_parts(msgs, MediaPolicy(), TEXT_MODEL) == []


# -- IP classification -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("127.0.0.1", "loopback"),
        ("127.255.0.9", "loopback"),
        ("::1", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("172.31.255.255", "private"),
        ("192.168.0.10", "private"),
        ("fc00::1", "private"),
        ("fd12:3456::1", "private"),
        ("169.254.1.1", "link-local"),
        ("fe80::1", "link-local"),
        ("169.254.169.254", "cloud metadata"),
        ("169.254.170.2", "cloud metadata"),
        ("100.100.100.200", "cloud metadata"),
        ("168.63.129.16", "cloud metadata"),
        ("fd00:ec2::254", "cloud metadata"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("fec0::1", "site-local"),
        ("100.64.0.1", "non-public"),
        ("192.0.2.1", "private"),
        ("198.18.0.1", "private"),
        ("240.0.0.1", "private"),
        ("255.255.255.255", "private"),
        ("::ffff:127.0.0.1", "loopback"),
        ("::ffff:10.0.0.1", "private"),
        ("::ffff:169.254.169.254", "cloud metadata"),
        ("64:ff9b::a9fe:a9fe", "cloud metadata"),
        ("64:ff9b::a00:1", "private"),
        ("2002:7f00:1::", "loopback"),
        ("2002:a9fe:a9fe::", "cloud metadata"),
        ("2001:0:4136:e378:8000:63bf:80ff:fffe", "loopback"),  # Teredo client 127.0.0.1
        ("8.8.8.8", None),
        ("1.1.1.1", None),
        ("2606:4700:4700::1111", None),
    ],
)
def test_address_classifier(address: str, reason: str | None) -> None:
    assert address_refusal(address) == reason


def test_allowed_networks_open_chosen_ranges_but_never_metadata() -> None:
    import ipaddress

    nets = [ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("169.254.0.0/16")]
    assert address_refusal("127.0.0.1", nets) is None
    assert address_refusal("169.254.1.1", nets) is None
    assert address_refusal("169.254.169.254", nets) == "cloud metadata"
    assert address_refusal("10.0.0.1", nets) == "private"


def test_static_url_check_returns_the_request_target() -> None:
    target = check_remote_url("https://Example.com/a/b.png?x=1#frag", [443])
    assert (target.host, target.port, target.target) == ("example.com", 443, "/a/b.png?x=1")
    assert check_remote_url("http://[2606:4700::1]/", [80]).literal is not None


# -- the fetcher against real loopback sockets ---------------------------------------------------
Route = Callable[[str, dict[str, str]], Awaitable[tuple[int, list[tuple[str, str]], bytes]]]


@dataclass
class LocalServer:
    """An HTTP/1.1 server on 127.0.0.1 whose answers depend on the path."""

    port: int = 0
    connections: int = 0
    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def _serve(local: LocalServer, other_port: int) -> asyncio.Server:
    async def answer(path: str) -> tuple[int, list[tuple[str, str]], bytes | None]:
        if path == "/ok":
            return 200, [("Content-Type", "image/png")], PNG
        if path == "/to-ok":
            return 302, [("Location", "/ok")], b""
        if path == "/to-private":
            return 302, [("Location", "http://10.1.2.3/x.png")], b""
        if path == "/to-metadata":
            return 301, [("Location", "http://169.254.169.254/latest/meta-data/")], b""
        if path == "/to-ipv6-loopback":
            return 307, [("Location", f"http://[::1]:{local.port}/ok")], b""
        if path == "/to-localhost":
            return 307, [("Location", f"http://localhost:{local.port}/ok")], b""
        if path == "/to-port":
            return 302, [("Location", f"http://127.0.0.1:{other_port}/ok")], b""
        if path == "/to-file":
            return 302, [("Location", "file:///etc/passwd")], b""
        if path == "/loop":
            return 302, [("Location", "/loop")], b""
        if path == "/big":
            return 200, [("Content-Length", "1000000")], b"x" * 100
        if path == "/gzip":
            return 200, [("Content-Encoding", "gzip")], b"\x1f\x8b"
        if path == "/missing":
            return 404, [], b"no"
        if path == "/slow":
            await asyncio.sleep(3600)
        return 200, [], None  # /stream: chunked without end

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        local.connections += 1
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            path = lines[0].split(" ")[1]
            headers = dict(
                (k.strip().lower(), v.strip())
                for k, _, v in (line.partition(":") for line in lines[1:] if line)
            )
            local.requests.append((path, headers))
            status, extra, body = await answer(path)
            if body is None:
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                for _ in range(1000):
                    writer.write(b"400\r\n" + b"y" * 1024 + b"\r\n")
                    await writer.drain()
                return
            names = {k.lower() for k, _ in extra}
            if "content-length" not in names:
                extra.append(("Content-Length", str(len(body))))
            head_out = f"HTTP/1.1 {status} X\r\n" + "".join(f"{k}: {v}\r\n" for k, v in extra)
            writer.write(head_out.encode() + b"Connection: close\r\n\r\n" + body)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    local.port = server.sockets[0].getsockname()[1]
    return server


def run_fetches(
    make_policy: Callable[[LocalServer], FetchPolicy],
    paths: list[str],
    *,
    base: Callable[[LocalServer], str] = lambda s: s.base,
) -> tuple[LocalServer, list[Any]]:
    """Start a local server, fetch each path under ``make_policy(server)``, stop the server."""
    local = LocalServer()

    async def main() -> list[Any]:
        server = await _serve(local, other_port=1)
        results: list[Any] = []
        try:
            for path in paths:
                try:
                    results.append(await fetch(base(local) + path, make_policy(local)))
                except FetchError as exc:
                    results.append(exc)
        finally:
            server.close()
            await server.wait_closed()
        return results

    return local, asyncio.run(main())


def loopback_allowed(local: LocalServer, **kw: Any) -> FetchPolicy:
    import ipaddress

    return FetchPolicy(
        max_bytes=kw.pop("max_bytes", 4096),
        allowed_ports=frozenset({80, 443, local.port}),
        allow_networks=(ipaddress.ip_network("127.0.0.0/8"),),
        **kw,
    )


def test_the_fetcher_refuses_loopback_before_connecting() -> None:
    def policy(local: LocalServer) -> FetchPolicy:
        return FetchPolicy(max_bytes=4096, allowed_ports=frozenset({local.port}))

    local, results = run_fetches(policy, ["/ok"])
    assert isinstance(results[0], FetchError)
    assert "loopback address" in str(results[0])
    # a name that resolves to loopback (from /etc/hosts) is refused after the one lookup
    local2, results2 = run_fetches(policy, ["/ok"], base=lambda s: f"http://localhost:{s.port}")
    assert "'localhost' resolves to a loopback address" in str(results2[0])
    assert local.connections == 0 and local2.connections == 0


def test_the_fetcher_fetches_from_an_allowed_network_and_reports_the_peer() -> None:
    local, results = run_fetches(loopback_allowed, ["/ok", "/to-ok"])
    first, second = results
    assert first.data == PNG and first.content_type == "image/png" and first.redirects == 0
    assert first.peers == ["127.0.0.1"]
    assert second.data == PNG and second.redirects == 1 and second.url.endswith("/ok")
    path, headers = local.requests[0]
    assert path == "/ok" and headers["host"] == f"127.0.0.1:{local.port}"
    assert headers["accept-encoding"] == "identity"


@pytest.mark.parametrize(
    ("path", "reason", "connections"),
    [
        ("/to-private", "the host is a private address", 1),
        ("/to-metadata", "the host is a cloud metadata address", 1),
        ("/to-ipv6-loopback", "the host is a loopback address", 1),
        ("/to-port", "port 1 is not allowed for remote media", 1),
        ("/to-file", "URL scheme 'file' is not allowed", 1),
        ("/loop", "redirected more than 3 times", 4),
        ("/big", "1000000 bytes, over the 4096-byte limit", 1),
        ("/stream", "over the 4096-byte limit", 1),
        ("/gzip", "'gzip'-encoded body", 1),
        ("/missing", "answered HTTP 404", 1),
    ],
)
def test_the_fetcher_rechecks_redirects_and_caps_bytes(
    path: str, reason: str, connections: int
) -> None:
    local, (result,) = run_fetches(loopback_allowed, [path])
    assert isinstance(result, FetchError), result
    assert reason in str(result)
    assert local.connections == connections  # refused hops were never connected to


def test_the_fetcher_caps_time() -> None:
    _, (result,) = run_fetches(lambda s: loopback_allowed(s, timeout=0.3), ["/slow"])
    assert isinstance(result, FetchError)
    assert "took longer than 0.3s" in str(result)


def test_remote_load_media_reports_fetch_refusals_as_400() -> None:
    policy = MediaPolicy.create(allow_remote=True)
    (ref,) = check_media_parts(image("http://localhost/cat.png"), policy, VISION_MODEL)
    with pytest.raises(APIError) as info:
        asyncio.run(load_media(ref, policy))
    assert info.value.status == 400
    assert info.value.message == (
        "messages.0.content.1.image_url.url: the host 'localhost' resolves to a loopback "
        "address, which remote media may not use"
    )


def test_images_inside_anthropic_tool_results_are_parts_in_their_place() -> None:
    png = base64.b64encode(PNG).decode()
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text"}, block]}
    messages = [{"role": "user", "content": [block, result, block]}]
    refs = check_media_parts(messages, MediaPolicy(), VISION_MODEL)
    assert [r.param.rsplit(".source", 1)[0] for r in refs] == [
        "messages.0.content.0",
        "messages.0.content.1.content.1",
        "messages.0.content.2",
    ]
    with pytest.raises(APIError) as info:  # a text model names the part inside the result
        check_media_parts([{"role": "user", "content": [result]}], MediaPolicy(), TEXT_MODEL)
    assert info.value.param == "messages.0.content.0.content.1"
    assert info.value.code == "unsupported_modality"
    many = MediaPolicy.create(max_num_images=2)  # they count toward the cap
    with pytest.raises(APIError, match="carries 3 images"):
        check_media_parts(messages, many, VISION_MODEL)
