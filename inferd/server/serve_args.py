"""The operational flags of `inferd serve` (kept free of web-stack imports: the parser is
built for every command) and their translation into build_app keyword arguments."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from inferd.server.defaults import (
    ACCESS_LOG_FORMATS,
    API_KEYS_ENV,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_LOGPROBS_TOKENS,
    DEFAULT_MAX_MEDIA_BYTES,
    DEFAULT_MAX_NUM_IMAGES,
    DEFAULT_MEDIA_FETCH_TIMEOUT,
)

if TYPE_CHECKING:
    from inferd.server.media import MediaPolicy


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The operational flags of `inferd serve`."""
    g = p.add_argument_group("security and limits")
    g.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help=f"require this key (repeatable; also {API_KEYS_ENV}, comma-separated)",
    )
    g.add_argument(
        "--allowed-origins",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="enable CORS for these origins (repeatable or comma-separated); off by default",
    )
    g.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body; larger gets 413 (default: 16 MiB)",
    )
    g.add_argument(
        "--max-header-bytes",
        type=int,
        default=DEFAULT_MAX_HEADER_BYTES,
        help="largest request head (request line + headers) (default: 16 KiB)",
    )
    g.add_argument(
        "--max-logprobs-tokens",
        type=int,
        default=DEFAULT_MAX_LOGPROBS_TOKENS,
        metavar="N",
        help="most (token, logprob) pairs one completions response may carry (n x scored "
        f"tokens x (1 + logprobs)); more gets 400 (default: {DEFAULT_MAX_LOGPROBS_TOKENS})",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="abort requests that run longer (default: no limit)",
    )
    g = p.add_argument_group("observability")
    g.add_argument(
        "--access-log-format",
        choices=[*ACCESS_LOG_FORMATS, "off"],
        default="text",
        help="one line per request start and end on stderr (default: text)",
    )
    g.add_argument(
        "--log-payloads",
        metavar="FILE",
        default=None,
        help="append request bodies (prompts!) to FILE as JSON lines; for debugging only",
    )
    g.add_argument("--no-metrics", action="store_true", help="do not serve /metrics")
    g.add_argument("--no-docs", action="store_true", help="do not serve /docs or /openapi.json")
    g = p.add_argument_group("media in requests")
    g.add_argument(
        "--allowed-media-root",
        action="append",
        default=[],
        metavar="DIR",
        help="allow file:// media under DIR (repeatable); file URLs are refused otherwise",
    )
    g.add_argument(
        "--allow-remote-media",
        action="store_true",
        help="allow http(s) media URLs, fetched from public addresses only",
    )
    g.add_argument(
        "--remote-media-ports",
        default="80,443",
        metavar="PORTS",
        help="ports remote media may use, comma-separated (default: 80,443)",
    )
    g.add_argument(
        "--max-num-images",
        type=int,
        default=DEFAULT_MAX_NUM_IMAGES,
        help=f"most images in one request (default: {DEFAULT_MAX_NUM_IMAGES})",
    )
    g.add_argument(
        "--max-media-bytes",
        type=int,
        default=DEFAULT_MAX_MEDIA_BYTES,
        help="largest single media item (default: 20 MiB)",
    )
    g.add_argument(
        "--media-fetch-timeout",
        type=float,
        default=DEFAULT_MEDIA_FETCH_TIMEOUT,
        metavar="SECONDS",
        help="time limit of one remote media fetch, redirects included (default: 10)",
    )


def validate_origins(origins: Sequence[str]) -> None:
    for origin in origins:
        if origin != "*" and not origin.startswith(("http://", "https://")):
            raise ValueError(f"allowed origin {origin!r} must be http(s)://host[:port]")


def app_options(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, Any]:
    """build_app keyword arguments from `inferd serve` flags; ValueError names a bad one."""
    from inferd.server.auth import keys_from_env, validate_keys
    from inferd.server.media import MediaPolicy

    if args.max_body_bytes < 1:
        raise ValueError("--max-body-bytes must be at least 1")
    if args.max_header_bytes < 1024:
        raise ValueError("--max-header-bytes must be at least 1024")
    if args.max_logprobs_tokens < 1:
        raise ValueError("--max-logprobs-tokens must be at least 1")
    if args.request_timeout is not None and args.request_timeout <= 0:
        raise ValueError("--request-timeout must be positive")
    try:
        ports = [int(p) for p in args.remote_media_ports.split(",") if p.strip()]
    except ValueError:
        raise ValueError("--remote-media-ports must be comma-separated port numbers") from None
    origins = [o.strip() for value in args.allowed_origins for o in value.split(",") if o.strip()]
    validate_origins(origins)
    keys = validate_keys([*args.api_key, *keys_from_env(environ)])
    policy = MediaPolicy.create(
        media_roots=args.allowed_media_root,
        allow_remote=args.allow_remote_media,
        remote_ports=ports,
        max_media_bytes=args.max_media_bytes,
        max_num_images=args.max_num_images,
        fetch_timeout=args.media_fetch_timeout,
    )
    return {
        "api_keys": keys,
        "max_body_bytes": args.max_body_bytes,
        "max_header_bytes": args.max_header_bytes,
        "max_logprobs_tokens": args.max_logprobs_tokens,
        "request_timeout": args.request_timeout,
        "allowed_origins": origins,
        "access_log_format": None if args.access_log_format == "off" else args.access_log_format,
        "log_payloads": args.log_payloads,
        "metrics": not args.no_metrics,
        "docs": not args.no_docs,
        "media_policy": policy,
    }


def describe(options: dict[str, Any]) -> list[str]:
    """Startup lines about the operational settings (never the keys themselves)."""
    keys = options["api_keys"]
    policy: MediaPolicy = options["media_policy"]
    auth = f"{len(keys)} API key(s) required" if keys else "none (no --api-key)"
    limit = options["request_timeout"]
    media = ["data:"]
    if policy.roots:
        media.append(f"file:// under {len(policy.roots)} root(s)")
    if policy.allow_remote:
        media.append("http(s) from public addresses")
    return [
        f"auth       {auth}",
        f"limits     body {options['max_body_bytes']} bytes, "
        f"timeout {'none' if limit is None else f'{limit:g}s'}",
        f"media      {', '.join(media)}; at most {policy.max_num_images} images, "
        f"{policy.max_media_bytes} bytes each",
    ]
