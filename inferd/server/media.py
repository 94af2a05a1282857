"""Media parts of requests (images, audio, video, files): URL policy and model modalities.

Policy, enforced before anything is read:

- ``data:`` URLs are decoded with a byte cap (``--max-media-bytes``), the size estimated from
  the encoded length first so an oversized payload is never decoded;
- ``file://`` URLs only name regular files under ``--allowed-media-root`` directories: no
  ``..`` components, the path must sit under a root as written and again once symbolic links
  are resolved, and files are opened read-only without following a final symlink;
- ``http(s)://`` URLs are refused unless ``--allow-remote-media``; then only the static checks
  of media_fetch run here (scheme, port, credentials, literal addresses) and the isolated
  fetcher does the rest (DNS once, public addresses only, redirects re-checked, caps).

Each refusal is a 400 naming the part (``messages.0.content.1.image_url.url``) and the reason.
Then each part's modality is checked against what the model accepts (``/v1/models`` shows
``modalities``): a text-only model asked to look at an image gets a 400 naming both.

Then ``decode_request_media`` (what the chat handlers call) loads each checked part
(``load_media``) and decodes it off the event loop with ``inferd.media`` under the policy's
``MediaLimits`` (pixels, seconds, frames, sample rate, all checked from the headers before the
heavy work); a part that is corrupt, truncated, over a limit or not what it claims to be is a
400 naming it (``messages.0.content.1.image_url``). A text-only model never gets that far: the
modality check refuses its media before anything is read.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import ipaddress
import math
import os
import stat
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, unquote_to_bytes, urlsplit

from starlette.requests import Request

from inferd.media.limits import MediaError, MediaLimits
from inferd.media.types import DecodedImage, DecodedMedia
from inferd.server.defaults import (
    DEFAULT_MAX_DECODED_PIXELS,
    DEFAULT_MAX_MEDIA_BYTES,
    DEFAULT_MAX_NUM_AUDIOS,
    DEFAULT_MAX_NUM_IMAGES,
    DEFAULT_MAX_NUM_VIDEOS,
    DEFAULT_MEDIA_FETCH_TIMEOUT,
)
from inferd.server.errors import APIError, bad_request
from inferd.server.media_budget import PixelBudget
from inferd.server.media_fetch import (
    DEFAULT_PORTS,
    MAX_URL_CHARS,
    FetchError,
    FetchPolicy,
    IPNetwork,
    check_remote_url,
    fetch,
)

if TYPE_CHECKING:
    from inferd.media.video import FrameSampling

MODALITIES = ("text", "image", "audio", "video", "file")

# OpenAI part types whose object (or string) under the same key holds a URL -> modality
_OPENAI_URL_PARTS = {
    "image_url": "image",
    "input_image": "image",
    "audio_url": "audio",
    "video_url": "video",
}
_MEDIA_TYPE_PREFIX = {"image": "image/", "audio": "audio/", "video": "video/"}
_INPUT_AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "m4a", "webm", "pcm16")


@dataclass(frozen=True, slots=True)
class Modalities:
    input: tuple[str, ...] = ("text",)
    output: tuple[str, ...] = ("text",)

    def card(self) -> dict[str, list[str]]:
        return {"input": list(self.input), "output": list(self.output)}


TEXT_ONLY = Modalities()


def model_modalities(model: object) -> Modalities:
    """What a served model takes and gives; text in, text out unless it says otherwise."""
    declared = getattr(model, "modalities", None)
    if isinstance(declared, Modalities):
        return declared
    if isinstance(declared, dict):
        return Modalities(
            tuple(declared.get("input", TEXT_ONLY.input)),
            tuple(declared.get("output", TEXT_ONLY.output)),
        )
    return TEXT_ONLY


@dataclass(frozen=True, slots=True)
class MediaRoot:
    given: Path  # absolute, normalized, as configured
    real: Path  # symlinks resolved


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    roots: tuple[MediaRoot, ...] = ()
    allow_remote: bool = False
    remote_ports: frozenset[int] = DEFAULT_PORTS
    max_media_bytes: int = DEFAULT_MAX_MEDIA_BYTES
    max_num_images: int = DEFAULT_MAX_NUM_IMAGES
    max_redirects: int = 3
    fetch_timeout: float = DEFAULT_MEDIA_FETCH_TIMEOUT
    allow_networks: tuple[IPNetwork, ...] = ()  # non-public networks remote media may use
    max_num_audios: int = DEFAULT_MAX_NUM_AUDIOS
    max_num_videos: int = DEFAULT_MAX_NUM_VIDEOS
    limits: MediaLimits = field(default_factory=MediaLimits)  # what decoding may take on
    # decoded image pixels alive at once, across requests (server/media_budget.py)
    pixel_budget: PixelBudget = field(default_factory=PixelBudget, compare=False)

    @classmethod
    def create(
        cls,
        *,
        media_roots: Iterable[str | Path] = (),
        allow_remote: bool = False,
        remote_ports: Iterable[int] = DEFAULT_PORTS,
        max_media_bytes: int = DEFAULT_MAX_MEDIA_BYTES,
        max_num_images: int = DEFAULT_MAX_NUM_IMAGES,
        max_redirects: int = 3,
        fetch_timeout: float = DEFAULT_MEDIA_FETCH_TIMEOUT,
        allow_networks: Iterable[str] = (),
        max_num_audios: int = DEFAULT_MAX_NUM_AUDIOS,
        max_num_videos: int = DEFAULT_MAX_NUM_VIDEOS,
        limits: MediaLimits | None = None,
        max_decoded_pixels: int = DEFAULT_MAX_DECODED_PIXELS,
    ) -> MediaPolicy:
        """Validate settings (ValueError says which); roots must be existing directories."""
        roots = []
        for raw in media_roots:
            given = Path(os.path.normpath(os.path.abspath(os.fspath(raw))))
            real = Path(os.path.realpath(given))
            if not real.is_dir():
                raise ValueError(f"--allowed-media-root {raw}: not an existing directory")
            roots.append(MediaRoot(given, real))
        ports = frozenset(int(p) for p in remote_ports)
        if not ports or any(not 0 < p < 65536 for p in ports):
            raise ValueError("remote media ports must be between 1 and 65535")
        if max_media_bytes < 1:
            raise ValueError("--max-media-bytes must be at least 1")
        for flag, count in (
            ("--max-num-images", max_num_images),
            ("--max-num-audios", max_num_audios),
            ("--max-num-videos", max_num_videos),
        ):
            if count < 0:
                raise ValueError(f"{flag} must not be negative")
        if max_redirects < 0 or fetch_timeout <= 0:
            raise ValueError("media redirects must be >= 0 and the fetch timeout positive")
        networks = tuple(ipaddress.ip_network(n, strict=False) for n in allow_networks)
        if max_decoded_pixels < 1:
            raise ValueError("--max-decoded-pixels must be at least 1")
        return cls(
            tuple(roots),
            allow_remote,
            ports,
            max_media_bytes,
            max_num_images,
            max_redirects,
            fetch_timeout,
            networks,
            max_num_audios,
            max_num_videos,
            limits or MediaLimits(),
            PixelBudget(max_decoded_pixels),
        )

    def fetch_policy(self) -> FetchPolicy:
        return FetchPolicy(
            max_bytes=self.max_media_bytes,
            timeout=self.fetch_timeout,
            max_redirects=self.max_redirects,
            allowed_ports=self.remote_ports,
            allow_networks=self.allow_networks,
        )


def media_policy(request: Request) -> MediaPolicy:
    """The app's policy (build_app's ``media_policy``); the strict default otherwise."""
    policy = getattr(request.app.state, "media_policy", None)
    return policy if isinstance(policy, MediaPolicy) else MediaPolicy()


@dataclass(frozen=True, slots=True)
class MediaRef:
    """A media part that passed the policy; ``load_media`` gets its bytes."""

    param: str  # where it sits in the request, e.g. messages.0.content.1.image_url.url
    modality: str
    source: str  # "data" | "file" | "remote"
    media_type: str | None = None
    data: bytes | None = field(default=None, repr=False)
    path: Path | None = None
    url: str | None = field(default=None, repr=False)


def check_media_parts(
    messages: Sequence[Any], policy: MediaPolicy, model: object = None
) -> list[MediaRef]:
    """Check every media part of ``messages`` (OpenAI parts or Anthropic blocks).

    Raises APIError 400: counts over the caps first, then each part's URL policy in order,
    then any part whose modality the model does not take. Returns the checked parts.
    """
    found = list(_media_parts(messages))
    for modality, plural, cap, flag, code in (
        ("image", "images", policy.max_num_images, "--max-num-images", "too_many_images"),
        ("audio", "audio clips", policy.max_num_audios, "--max-num-audios", "too_many_audios"),
        ("video", "videos", policy.max_num_videos, "--max-num-videos", "too_many_videos"),
    ):
        count = sum(1 for _, m, _ in found if m == modality)
        if count > cap:
            raise bad_request(
                f"messages: this request carries {count} {plural}; this server accepts at most "
                f"{cap} per request ({flag})",
                "messages",
                code=code,
            )
    refs = [_check_part(param, modality, part, policy) for param, modality, part in found]
    accepted = model_modalities(model).input
    for ref in refs:
        if ref.modality not in accepted:
            name = getattr(model, "id", None) or "this model"
            raise bad_request(
                f"{_part_param(ref.param)}: the model {name!r} does not accept {ref.modality} "
                f"input; it accepts {', '.join(accepted)}",
                _part_param(ref.param),
                code="unsupported_modality",
            )
    return refs


def _part_param(param: str) -> str:
    """messages.0.content.1.image_url.url -> messages.0.content.1 (and the innermost part of
    a tool result's content: messages.0.content.1.content.0.source -> ...content.1.content.0)"""
    head, found, rest = param.rpartition(".content.")
    index = rest.split(".", 1)[0]
    return f"{head}.content.{index}" if found else param


def _media_parts(messages: Sequence[Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else message.content
        if not isinstance(content, list):
            continue
        yield from _parts_of(content, f"messages.{i}.content")


def _parts_of(content: list[Any], where: str) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """Media parts of a content list in order, those of an Anthropic tool_result's own content
    list at its place among them."""
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if kind is not None and not isinstance(kind, str):
            # an object or array here is unhashable: the lookups below would raise
            raise bad_request(f"{where}.{j}.type must be a string", f"{where}.{j}.type")
        modality = _modality_of(kind)
        if modality is not None:
            yield f"{where}.{j}", modality, part
        elif kind == "tool_result" and isinstance(part.get("content"), list):
            yield from _parts_of(part["content"], f"{where}.{j}.content")


def _modality_of(kind: object) -> str | None:
    if kind in _OPENAI_URL_PARTS:
        return _OPENAI_URL_PARTS[str(kind)]
    if kind == "input_audio":
        return "audio"
    if kind in ("file", "document"):
        return "file"
    if kind == "image":
        return "image"  # Anthropic image block
    return None


def _check_part(prefix: str, modality: str, part: dict[str, Any], policy: MediaPolicy) -> MediaRef:
    kind = str(part.get("type"))
    if kind in _OPENAI_URL_PARTS:
        value = part.get(kind)
        if isinstance(value, dict):
            return check_url(value.get("url"), modality, policy, f"{prefix}.{kind}.url")
        return check_url(value, modality, policy, f"{prefix}.{kind}")
    if kind == "input_audio":
        value = part.get("input_audio")
        param = f"{prefix}.input_audio"
        if not isinstance(value, dict):
            raise bad_request(f"{param} must be an object with data and format", param)
        fmt = value.get("format")
        if fmt not in _INPUT_AUDIO_FORMATS:
            raise bad_request(
                f"{param}.format must be one of {', '.join(_INPUT_AUDIO_FORMATS)}",
                f"{param}.format",
            )
        data = _decode_base64(value.get("data"), policy, f"{param}.data")
        return MediaRef(f"{param}.data", modality, "data", f"audio/{fmt}", data)
    if kind == "file":
        value = part.get("file")
        param = f"{prefix}.file"
        if not isinstance(value, dict):
            raise bad_request(f"{param} must be an object", param)
        if value.get("file_id") is not None:
            raise bad_request(
                f"{param}.file_id: a file id is not read here; send file_data instead",
                f"{param}.file_id",
            )
        file_data = value.get("file_data")
        if isinstance(file_data, str) and file_data[:5].lower() == "data:":
            return check_url(file_data, modality, policy, f"{param}.file_data")
        data = _decode_base64(file_data, policy, f"{param}.file_data")
        return MediaRef(f"{param}.file_data", modality, "data", None, data)
    # Anthropic image / document blocks: {"source": {"type": "base64"|"url"|..., ...}}
    source = part.get("source")
    param = f"{prefix}.source"
    if not isinstance(source, dict):
        raise bad_request(f"{param} must be an object", param)
    source_type = source.get("type")
    if source_type == "url":
        return check_url(source.get("url"), modality, policy, f"{param}.url")
    if source_type == "base64":
        media_type = source.get("media_type")
        if media_type is not None and not isinstance(media_type, str):
            raise bad_request(f"{param}.media_type must be a string", f"{param}.media_type")
        _check_media_type(media_type, modality, f"{param}.media_type")
        data = _decode_base64(source.get("data"), policy, f"{param}.data")
        return MediaRef(f"{param}.data", modality, "data", media_type, data)
    raise bad_request(
        f"{param}.type {str(source_type)[:32]!r} is not supported; use base64 or url",
        f"{param}.type",
    )


def check_url(url: object, modality: str, policy: MediaPolicy, param: str) -> MediaRef:
    """Apply the URL policy to one media URL; raises APIError 400 saying why."""
    if not isinstance(url, str) or not url:
        raise bad_request(f"{param} must be a non-empty URL string", param)
    scheme, sep, _ = url.partition(":")
    scheme = scheme.lower() if sep else ""
    if scheme == "data":
        media_type, data = _decode_data_url(url, policy, param)
        _check_media_type(media_type, modality, param)
        return MediaRef(param, modality, "data", media_type, data)
    if len(url) > MAX_URL_CHARS:
        raise bad_request(f"{param}: the URL is longer than {MAX_URL_CHARS} characters", param)
    if scheme == "file":
        return MediaRef(param, modality, "file", path=_check_file_url(url, policy, param))
    if scheme in ("http", "https"):
        if not policy.allow_remote:
            raise _refused(
                param,
                "remote media URLs (http/https) are not allowed on this server "
                "(start it with --allow-remote-media)",
            )
        try:
            check_remote_url(url, policy.remote_ports, policy.allow_networks)
        except FetchError as exc:
            raise _refused(param, str(exc)) from None
        return MediaRef(param, modality, "remote", url=url)
    shown = f"URL scheme {scheme[:16]!r}" if scheme else "a URL without a scheme"
    raise _refused(
        param,
        f"{shown} is not supported for media; use data:, file:// (with --allowed-media-root) "
        "or http(s):// (with --allow-remote-media)",
    )


def _refused(param: str, reason: str) -> APIError:
    return bad_request(f"{param}: {reason}", param, code="media_url_refused")


def decode_inline(value: object, policy: MediaPolicy, param: str) -> tuple[str | None, bytes]:
    """A file sent inline (a ``data:`` URL, or bare base64) as (its media type, its bytes),
    under the policy's size cap."""
    if isinstance(value, str) and value[:5].lower() == "data:":
        return _decode_data_url(value, policy, param)
    return None, _decode_base64(value, policy, param)


def _decode_data_url(url: str, policy: MediaPolicy, param: str) -> tuple[str | None, bytes]:
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise _refused(param, "malformed data URL: no ',' before the data")
    if len(header) > 256:
        raise _refused(param, "malformed data URL: the media type is too long")
    fields = [f.strip() for f in header.split(";")]
    is_base64 = len(fields) > 1 and fields[-1].lower() == "base64"
    media_type = fields[0].lower() or None
    if media_type is not None and (media_type.count("/") != 1 or not media_type.isascii()):
        raise _refused(param, f"malformed data URL: {media_type[:64]!r} is not a media type")
    cap = policy.max_media_bytes
    if is_base64:
        data = _decode_base64(payload, policy, param)
    else:
        if len(payload) > 3 * cap:  # each byte takes at most 3 characters (%XX)
            raise _too_big(param, cap)
        data = unquote_to_bytes(payload)
        if len(data) > cap:
            raise _too_big(param, cap)
    if not data:
        raise _refused(param, "the data URL holds no data")
    return media_type, data


def _decode_base64(value: object, policy: MediaPolicy, param: str) -> bytes:
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param} must be a non-empty base64 string", param)
    cap = policy.max_media_bytes
    padding = len(value) - len(value.rstrip("="))
    if (len(value) // 4) * 3 - min(padding, 2) > cap:
        raise _too_big(param, cap)
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise _refused(param, "the data is not valid base64") from None
    if len(data) > cap:
        raise _too_big(param, cap)
    return data


def _too_big(param: str, cap: int) -> APIError:
    return _refused(param, f"the media is larger than {cap} bytes (--max-media-bytes)")


def _check_media_type(media_type: str | None, modality: str, param: str) -> None:
    prefix = _MEDIA_TYPE_PREFIX.get(modality)
    if media_type is None or prefix is None:
        return
    if not media_type.lower().startswith(prefix):
        raise _refused(param, f"the media type {media_type[:64]!r} is not {modality} media")


def _check_file_url(url: str, policy: MediaPolicy, param: str) -> Path:
    if not policy.roots:
        raise _refused(
            param,
            "file:// URLs are not allowed on this server (start it with --allowed-media-root DIR)",
        )
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise _refused(param, "file:// URLs must not name a host")
    if parts.query or parts.fragment or "?" in url or "#" in url:
        raise _refused(param, "file:// URLs must not have a query or fragment")
    try:
        raw_path = unquote(parts.path, errors="strict")
    except UnicodeDecodeError:
        raise _refused(param, "the file path is not valid UTF-8 once percent-decoded") from None
    if "\x00" in raw_path:
        raise _refused(param, "the file path contains a NUL byte")
    if not raw_path.startswith("/"):
        raise _refused(param, "file:// URLs must hold an absolute path")
    if ".." in raw_path.split("/"):
        raise _refused(param, "the file path must not contain '..'")
    lexical = Path(os.path.normpath(raw_path))
    if not any(_under(lexical, r.given) or _under(lexical, r.real) for r in policy.roots):
        raise _refused(param, "the file is outside the allowed media roots")
    real = Path(os.path.realpath(lexical))
    if not any(_under(real, r.real) for r in policy.roots):
        raise _refused(param, "the file path leaves the allowed media roots through a symlink")
    try:
        st = os.stat(real)
    except FileNotFoundError:
        raise _refused(param, "no such file under the allowed media roots") from None
    except OSError:
        raise _refused(param, "the file cannot be read") from None
    if not stat.S_ISREG(st.st_mode):
        raise _refused(param, "the path is not a regular file")
    if st.st_size > policy.max_media_bytes:
        raise _too_big(param, policy.max_media_bytes)
    return real


def _under(path: Path, root: Path) -> bool:
    return path == root or path.is_relative_to(root)


def read_media_file(path: Path, policy: MediaPolicy) -> bytes:
    """Read a checked file: read-only, final symlink not followed, re-checked after opening."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    flags |= getattr(os, "O_NONBLOCK", 0)  # never block on a FIFO swapped in
    try:
        fd = os.open(path, flags)
    except OSError:
        raise FetchError("the file cannot be opened") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FetchError("the path is not a regular file")
        opened = Path(f"/proc/self/fd/{fd}")
        if opened.exists():
            real = Path(os.path.realpath(opened))
            if not any(_under(real, r.real) for r in policy.roots):
                raise FetchError("the file left the allowed media roots")
        data = f.read(policy.max_media_bytes + 1)
    if len(data) > policy.max_media_bytes:
        raise FetchError(f"the media is larger than {policy.max_media_bytes} bytes")
    return data


async def load_media(ref: MediaRef, policy: MediaPolicy) -> bytes:
    """The bytes of a checked part (for multimodal models). Raises APIError 400 on refusal."""
    try:
        if ref.source == "data":
            assert ref.data is not None
            return ref.data
        if ref.source == "file":
            assert ref.path is not None
            return await asyncio.to_thread(read_media_file, ref.path, policy)
        assert ref.url is not None
        fetched = await fetch(ref.url, policy.fetch_policy())
        return fetched.data
    except FetchError as exc:
        raise _refused(ref.param, str(exc)) from None


async def decode_request_media(
    messages: Sequence[Any],
    policy: MediaPolicy,
    model: object = None,
    *,
    audio_rate: int | None = None,
    video_sampling: FrameSampling | None = None,
    video_audio: bool = False,
) -> list[DecodedMedia]:
    """The request's media, checked, loaded and decoded, in the order they appear.

    Raises APIError 400 for anything ``check_media_parts`` refuses (a text-only model's media
    among them, before any byte is read), for a part that cannot be loaded, and for one that
    cannot be decoded (the message names the part and says why). ``audio_rate`` resamples
    audio to the model's rate; ``video_sampling`` picks the frames kept; ``video_audio`` adds
    a video's sound (for models that hear videos too).

    Before any decoding, every image's header is read: its size is checked, what it costs
    the model in prompt tokens is summed (a request whose images alone overflow the context
    is the context-length 400 now, not after seconds of decoding), and its pixels are taken
    from the process-wide budget (server/media_budget.py: wait, or 400/503). Each decode then
    runs off the event loop in the decoding threads, one part after another, so one request
    holds at most one of them at a time.
    """
    refs = check_media_parts(messages, policy, model)
    for ref in refs:
        if ref.modality == "file":
            raise bad_request(
                f"{_part_key(ref.param)}: file (document) parts are not decoded by this server",
                _part_key(ref.param),
                code="unsupported_modality",
            )
    loaded = [(ref, await load_media(ref, policy)) for ref in refs]
    loop = asyncio.get_running_loop()
    sizes = {
        i: await loop.run_in_executor(_DECODERS, _image_size, ref, data, policy.limits)
        for i, (ref, data) in enumerate(loaded)
        if ref.modality == "image"
    }
    # priced at the size the model gets (--max-edge scales the long side down)
    images = [(loaded[i][0], policy.limits.fitted(*size)) for i, size in sizes.items()]
    check_image_tokens(model, images, text_chars(messages))
    budget = policy.pixel_budget
    pending = {i: w * h for i, (w, h) in sizes.items()}  # taken, not yet handed to an image
    await budget.acquire(sum(pending.values()))
    decoded = []
    try:
        for i, (ref, data) in enumerate(loaded):
            work = functools.partial(
                _decode, ref, data, policy.limits, audio_rate, video_sampling, video_audio
            )
            item = await loop.run_in_executor(_DECODERS, work)
            if i in pending and isinstance(item, DecodedImage):
                budget.release_when_freed(item.image, pending.pop(i))
            decoded.append(item)
    finally:
        if pending:  # images never decoded (a failure part way, or cancelled)
            budget.release(sum(pending.values()))
    return decoded


def check_image_tokens(
    model: object, images: Sequence[tuple[MediaRef, tuple[int, int]]], text_chars: int = 0
) -> None:
    """Refuse, before decoding, images whose prompt tokens with the request's text leave the
    model's context no room to generate (a lower bound from the header sizes:
    ``ServedModel.image_tokens``; the text's from its characters, as ``check_fits`` bounds
    it); a size the model's processor refuses is a 400 naming the part."""
    cost = getattr(model, "image_tokens", None)
    engine = getattr(model, "engine", None)
    limit = getattr(engine, "max_model_len", None)
    if cost is None or not isinstance(limit, int) or not images:
        return
    total = 0
    for ref, (width, height) in images:
        try:
            tokens = cost(width, height)
        except ValueError as exc:  # MediaPromptError: e.g. more tiles than can be marked
            param = _part_key(ref.param)
            raise bad_request(f"{param}: {exc}", param) from None
        total += tokens or 0
    per_token = getattr(getattr(model, "tokenizer", None), "max_chars_per_token", None)
    text = math.ceil(text_chars / per_token) if isinstance(per_token, int) and per_token else 0
    if total + text >= limit:  # a prompt of the whole context leaves no room to generate
        with_text = f" and the text at least {text} more" if text else ""
        raise bad_request(
            f"messages: the {len(images)} images take at least {total} prompt tokens"
            f"{with_text}, which leaves no room to generate: this model's maximum context "
            f"length is {limit} tokens; send fewer or smaller images",
            "messages",
            code="context_length_exceeded",
        )


def text_chars(messages: Sequence[Any]) -> int:
    """Characters of the messages' text (string contents and text parts): the rendered prompt
    holds at least these."""
    count = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else message.content
        parts = [content] if isinstance(content, str) else content or []
        for part in parts:
            text = (
                part
                if isinstance(part, str)
                else part.get("text")
                if isinstance(part, dict)
                else None
            )
            count += len(text) if isinstance(text, str) else 0
    return count


def _image_size(ref: MediaRef, data: bytes, limits: MediaLimits) -> tuple[int, int]:
    from inferd.media.image import image_size

    try:
        return image_size(data, limits, declared_type(ref))
    except MediaError as exc:
        param = _part_key(ref.param)
        raise bad_request(f"{param}: {exc}", param, code=exc.code) from None


# Decoding is CPU- and memory-heavy: its own few threads, so many requests with media queue
# here instead of decoding all at once, and never hold up the default executor's short jobs
# (tokenizing, reading files).
_DECODERS = ThreadPoolExecutor(
    max_workers=max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="inferd-media"
)


def _decode(
    ref: MediaRef,
    data: bytes,
    limits: MediaLimits,
    audio_rate: int | None,
    video_sampling: FrameSampling | None,
    video_audio: bool,
) -> DecodedMedia:
    from inferd.media.decode import decode_media

    try:
        return decode_media(
            data,
            ref.modality,
            limits,
            declared_type(ref),
            audio_rate=audio_rate,
            video_sampling=video_sampling,
            video_audio=video_audio,
        )
    except MediaError as exc:
        param = _part_key(ref.param)
        raise bad_request(f"{param}: {exc}", param, code=exc.code) from None


def declared_type(ref: MediaRef) -> str | None:
    """The media type the sender declared (a data URL's, a block's ``media_type``, an
    ``input_audio`` format), checked against the bytes. A file's or URL's name declares
    nothing: the bytes say what it is."""
    return ref.media_type


def _part_key(param: str) -> str:
    """messages.0.content.1.image_url.url -> messages.0.content.1.image_url: the part's object."""
    head, _, last = param.rpartition(".")
    return head if last in ("url", "data", "file_data") and ".content." in head else param
