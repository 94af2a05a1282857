"""The operational flags of `inferd serve` (kept free of web-stack imports: the parser is
built for every command) and their translation into ServerOptions (options.py)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

from inferd.agent.config import (
    DEFAULT_APPROVAL_TIMEOUT_S,
    DEFAULT_MAX_TOOL_ROUNDS,
    DEFAULT_PERMISSION,
)
from inferd.server.defaults import (
    ACCESS_LOG_FORMATS,
    ADMIN_KEYS_ENV,
    API_KEYS_ENV,
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_AUDIO_SAMPLE_RATE,
    DEFAULT_MAX_AUDIO_SECONDS,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_DECODED_PIXELS,
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_FILES_TOTAL_BYTES,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_LOGPROBS_TOKENS,
    DEFAULT_MAX_MEDIA_BYTES,
    DEFAULT_MAX_NUM_AUDIOS,
    DEFAULT_MAX_NUM_IMAGES,
    DEFAULT_MAX_NUM_VIDEOS,
    DEFAULT_MAX_VIDEO_FRAMES,
    DEFAULT_MAX_VIDEO_SECONDS,
    DEFAULT_MEDIA_FETCH_TIMEOUT,
    DEFAULT_RESPONSES_TTL,
)
from inferd.structured.tool_syntax import PARSERS

if TYPE_CHECKING:
    from inferd.server.options import ServerOptions
    from inferd.server.transport import ConnectionLimits


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
        "--admin-key",
        action="append",
        default=[],
        metavar="KEY",
        help=f"the model lifecycle routes (/v1/models/unload|reload|status) take only this key "
        f"(repeatable; also {ADMIN_KEYS_ENV}); without one they are off on a non-loopback --host",
    )
    g.add_argument(
        "--admin-routes",
        choices=["auto", "off"],
        default="auto",
        help="off: the lifecycle, LoRA and skill-changing routes answer 404 whatever the keys "
        "and --host (auto: on with an --admin-key, or on a loopback --host)",
    )
    g.add_argument(
        "--allowed-hosts",
        action="append",
        default=[],
        metavar="HOST",
        help="answer requests whose Host header names HOST[:PORT] too (repeatable or "
        "comma-separated; '*': any Host, which lets DNS-rebinding pages in); by default only "
        "the loopback names and the --host address, with --port",
    )
    g.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help=f"open connections beyond which requests get 503 (default: {DEFAULT_MAX_CONNECTIONS})",
    )
    g.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT,
        metavar="SECONDS",
        help="time for a whole request head, from the connection's start or the previous "
        f"answer; later: 408 and close (default: {DEFAULT_HEADER_TIMEOUT:g})",
    )
    g.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT,
        metavar="SECONDS",
        help="time for a request body after its head, plus a second per 32 KiB received; "
        f"later: 408 (default: {DEFAULT_BODY_TIMEOUT:g})",
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
        "--allow-special-tokens-in-content",
        action="store_true",
        help="let special-token text in messages (<|im_start|>...) become control tokens, so "
        "message content can forge turns; off by default: only the chat template makes them",
    )
    g.add_argument(
        "--reasoning-parser",
        default="auto",
        choices=("auto", "think", "none"),
        help="split a reply's <think>...</think> reasoning from its answer (reasoning_content, "
        "reasoning items, thinking blocks): auto when the chat template mentions <think>, "
        "think always, none never (default: auto)",
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
    g = p.add_argument_group("stored responses (/v1/responses)")
    g.add_argument(
        "--responses-store",
        default=None,
        metavar="PATH",
        help="the SQLite file of stored responses, or ':memory:' to keep none past the "
        "process (default: responses.sqlite3 under INFERD_HOME)",
    )
    g.add_argument(
        "--files-dir",
        default=None,
        metavar="DIR",
        help="the folder of /v1/files (default: files/ beside --responses-store; a temporary "
        "folder when that is ':memory:')",
    )
    g.add_argument(
        "--max-file-bytes",
        type=int,
        default=DEFAULT_MAX_FILE_BYTES,
        metavar="N",
        help="the largest file /v1/files takes, and the largest a code run's output file "
        f"stored there (default: {DEFAULT_MAX_FILE_BYTES}; an upload is also one request "
        "body, under --max-body-bytes)",
    )
    g.add_argument(
        "--max-files-total-bytes",
        type=int,
        default=DEFAULT_MAX_FILES_TOTAL_BYTES,
        metavar="N",
        help=f"all the files of /v1/files together (default: {DEFAULT_MAX_FILES_TOTAL_BYTES})",
    )
    g.add_argument(
        "--responses-ttl",
        type=float,
        default=DEFAULT_RESPONSES_TTL,
        metavar="SECONDS",
        help="how long a stored response lives (default: 30 days)",
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
    g.add_argument(
        "--no-docs",
        action="store_true",
        help="do not serve the OpenAPI document (/openapi.json, /api-doc/openapi.json)",
    )
    g.add_argument(
        "--docs-base-path",
        metavar="PREFIX",
        default="",
        help="serve the OpenAPI document under PREFIX (e.g. /internal: /internal/openapi.json)",
    )
    g.add_argument(
        "--ui",
        choices=("auto", "on", "off"),
        default="auto",
        help="serve a chat page at / (auto: only when --host is a loopback address)",
    )
    g.add_argument(
        "--mcp-route",
        action="store_true",
        help="serve the models as MCP tools (chat, complete, embed, list_models) at /mcp, "
        "streamable HTTP, behind the API key like every route (off by default; `inferd mcp` "
        "serves them over stdio)",
    )
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
        "--max-num-audios",
        type=int,
        default=DEFAULT_MAX_NUM_AUDIOS,
        help=f"most audio clips in one request (default: {DEFAULT_MAX_NUM_AUDIOS})",
    )
    g.add_argument(
        "--max-num-videos",
        type=int,
        default=DEFAULT_MAX_NUM_VIDEOS,
        help=f"most videos in one request (default: {DEFAULT_MAX_NUM_VIDEOS})",
    )
    g.add_argument(
        "--max-image-pixels",
        type=int,
        default=DEFAULT_MAX_IMAGE_PIXELS,
        help="largest image (and video frame) decoded, width x height, checked from the header "
        f"before decoding (default: {DEFAULT_MAX_IMAGE_PIXELS})",
    )
    g.add_argument(
        "--max-edge",
        "--max-image-length",
        dest="max_edge",
        type=int,
        default=None,
        metavar="PX",
        help="scale each decoded image down so its long side is at most PX pixels, aspect kept "
        "(before the model's own processor; it also prices the image's prompt tokens at that "
        "size) (default: images as they come)",
    )
    g.add_argument(
        "--max-decoded-pixels",
        type=int,
        default=DEFAULT_MAX_DECODED_PIXELS,
        help="image pixels decoded and held at once across all requests; a request waits for "
        "its images' share (503 after a minute), more than all of it is a 400 "
        f"(default: {DEFAULT_MAX_DECODED_PIXELS})",
    )
    g.add_argument(
        "--max-video-seconds",
        type=float,
        default=DEFAULT_MAX_VIDEO_SECONDS,
        help=f"longest video decoded (default: {DEFAULT_MAX_VIDEO_SECONDS:g})",
    )
    g.add_argument(
        "--max-video-frames",
        type=int,
        default=DEFAULT_MAX_VIDEO_FRAMES,
        help="most frames in a video stream, all decoded to sample a few "
        f"(default: {DEFAULT_MAX_VIDEO_FRAMES})",
    )
    g.add_argument(
        "--max-audio-seconds",
        type=float,
        default=DEFAULT_MAX_AUDIO_SECONDS,
        help=f"longest audio clip decoded (default: {DEFAULT_MAX_AUDIO_SECONDS:g})",
    )
    g.add_argument(
        "--max-audio-sample-rate",
        type=int,
        default=DEFAULT_MAX_AUDIO_SAMPLE_RATE,
        metavar="HZ",
        help=f"highest audio sample rate decoded (default: {DEFAULT_MAX_AUDIO_SAMPLE_RATE})",
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
    g = p.add_argument_group("LoRA adapters loaded at runtime")
    g.add_argument(
        "--lora-root",
        dest="lora_roots",
        action="append",
        default=[],
        metavar="DIR",
        help="allow POST /v1/load_lora_adapter to read adapters under DIR (repeatable); "
        "runtime loading is refused otherwise",
    )
    g = p.add_argument_group("tool calls")
    g.add_argument(
        "--tool-call-parser",
        choices=PARSERS,
        default=None,
        help="the syntax the model writes tool calls in (default: the one its chat template "
        "shows; hermes when it shows none); goes with -m, tool_call_parser in a --config file",
    )
    g = p.add_argument_group("agent tools (server-side tool sources; see README)")
    g.add_argument(
        "--mcp-config",
        default=None,
        metavar="FILE",
        help='MCP servers whose tools the server may run (JSON: {"mcpServers": {...}})',
    )
    g.add_argument(
        "--tool-dispatch-url",
        default=None,
        metavar="URL",
        help='run a request\'s own tools by POSTing {"name", "arguments"} to URL',
    )
    g.add_argument(
        "--max-tool-rounds",
        type=int,
        default=DEFAULT_MAX_TOOL_ROUNDS,
        metavar="N",
        help=f"most tool rounds in one request (default: {DEFAULT_MAX_TOOL_ROUNDS})",
    )
    g.add_argument(
        "--agent-permission",
        choices=("allow", "ask", "deny"),
        default=DEFAULT_PERMISSION,
        help="whether a server-side tool call runs, waits for approval or is refused, unless "
        f"the MCP config says otherwise for the server or tool (default: {DEFAULT_PERMISSION})",
    )
    g.add_argument(
        "--agent-approval-timeout",
        type=float,
        default=DEFAULT_APPROVAL_TIMEOUT_S,
        metavar="SECONDS",
        help="how long a call needing approval waits for POST /v1/agent/approvals/{id} before "
        f"it is denied (default: {DEFAULT_APPROVAL_TIMEOUT_S:g})",
    )
    g.add_argument(
        "--mcp-allow-url",
        action="append",
        default=[],
        metavar="PATTERN",
        help="let requests name MCP servers matching scheme://host[:port][/path] (host may be "
        "*.name; repeatable); none by default, and never link-local or metadata addresses",
    )
    g.add_argument(
        "--enable-code-execution",
        action="store_true",
        help="offer the agent loop a `python` tool running model-written code in a bubblewrap "
        "sandbox (no network, no host files; see README); off by default",
    )
    g.add_argument(
        "--skills-dir",
        default=None,
        metavar="DIR",
        help="offer the agent loop the skills in DIR (folders with a SKILL.md; the model loads "
        "one with load_skill) and manage them at /v1/skills; off by default",
    )
    g = p.add_argument_group("web search (web_search_options, the Responses web_search tool)")
    g.add_argument(
        "--search-dir",
        default=None,
        metavar="DIR",
        help="answer web search from a local index of the .md, .txt and .html files under DIR "
        "(SQLite FTS5, bm25); off by default",
    )
    g.add_argument(
        "--search-embedding-model",
        default=None,
        metavar="ID",
        help="rerank --search-dir's hits by cosine similarity with this served embedding model "
        "(e.g. minilm, loaded with --config)",
    )
    g.add_argument(
        "--search-url",
        default=None,
        metavar="URL",
        help='answer web search by POSTing {"query", "k"} to URL, which answers '
        '{"results": [{"title", "url", "snippet"}]}',
    )


def server_options(args: argparse.Namespace, environ: Mapping[str, str]) -> ServerOptions:
    """ServerOptions from `inferd serve` flags; ValueError names a bad one.

    A flag whose dest is a ServerOptions field's name is taken as is; the rest are translated
    below."""
    from inferd.agent.config import agent_config
    from inferd.media.limits import MediaLimits
    from inferd.server.auth import keys_from_env
    from inferd.server.crosssite import HostAllowList, is_loopback
    from inferd.server.media import MediaPolicy
    from inferd.server.options import ServerOptions
    from inferd.store import default_home

    try:
        ports = [int(p) for p in args.remote_media_ports.split(",") if p.strip()]
    except ValueError:
        raise ValueError("--remote-media-ports must be comma-separated port numbers") from None
    base = args.docs_base_path
    segments = base.split("/")[1:]
    if base and (not re.fullmatch(r"(/[A-Za-z0-9._~-]+)+", base) or {".", ".."} & set(segments)):
        raise ValueError(
            f"--docs-base-path {base!r}: give a path such as /internal (segments of letters, "
            "digits and ._~-, no trailing slash)"
        )
    admin_keys = (*args.admin_key, *keys_from_env(environ, ADMIN_KEYS_ENV))
    responses_store = args.responses_store or str(default_home() / "responses.sqlite3")
    given = vars(args)
    same_name = {f.name: given[f.name] for f in fields(ServerOptions) if f.name in given}
    return ServerOptions(
        **same_name
        | {
            "default_model": args.default_model_id,
            "auto_reload": args.auto_reload == "on",
            "api_keys": (*args.api_key, *keys_from_env(environ)),
            "admin_keys": admin_keys,
            "admin_routes": args.admin_routes != "off"
            and (bool(admin_keys) or is_loopback(args.host)),
            "allowed_hosts": HostAllowList.for_server(
                args.host, args.port, [h for value in args.allowed_hosts for h in value.split(",")]
            ),
            "allowed_origins": tuple(
                o.strip() for value in args.allowed_origins for o in value.split(",") if o.strip()
            ),
            "access_log_format": (
                None if args.access_log_format == "off" else args.access_log_format
            ),
            "responses_store": responses_store,
            "files_dir": args.files_dir or _files_dir(responses_store),
            "metrics": not args.no_metrics,
            "agent": agent_config(
                mcp_config=args.mcp_config,
                dispatch_url=args.tool_dispatch_url,
                max_tool_rounds=args.max_tool_rounds,
                permission=args.agent_permission,
                mcp_allow_urls=args.mcp_allow_url,
                code_execution=args.enable_code_execution,
                approval_timeout_s=args.agent_approval_timeout,
                skills_dir=args.skills_dir,
                search_dir=args.search_dir,
                search_url=args.search_url,
                search_embedding_model=args.search_embedding_model,
            ),
            "docs": not args.no_docs,
            "ui": args.ui == "on" or (args.ui == "auto" and is_loopback(args.host)),
            "media_policy": MediaPolicy.create(
                media_roots=args.allowed_media_root,
                allow_remote=args.allow_remote_media,
                remote_ports=ports,
                max_media_bytes=args.max_media_bytes,
                max_num_images=args.max_num_images,
                max_num_audios=args.max_num_audios,
                max_num_videos=args.max_num_videos,
                fetch_timeout=args.media_fetch_timeout,
                max_decoded_pixels=args.max_decoded_pixels,
                limits=MediaLimits(
                    max_image_pixels=args.max_image_pixels,
                    max_video_seconds=args.max_video_seconds,
                    max_video_frames=args.max_video_frames,
                    max_audio_seconds=args.max_audio_seconds,
                    max_audio_sample_rate=args.max_audio_sample_rate,
                    max_image_edge=args.max_edge,
                ),
            ),
        }
    )


def _files_dir(responses_store: str) -> str | None:
    """files/ beside the responses store; None (a temporary folder) when it is in memory."""
    if responses_store == ":memory:":
        return None
    return str(Path(responses_store).parent / "files")


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    """The uvicorn-level limits of `inferd serve` (head timeout, connection cap)."""
    from inferd.server.transport import ConnectionLimits

    if args.header_timeout <= 0:
        raise ValueError("--header-timeout must be positive")
    if args.max_connections < 1:
        raise ValueError("--max-connections must be at least 1")
    return ConnectionLimits(args.header_timeout, args.max_connections)


def describe(options: ServerOptions) -> list[str]:
    """Startup lines about the operational settings (never the keys themselves)."""
    from inferd.server.admin import describe as describe_admin

    keys = options.api_keys
    policy = options.media_policy
    lim = policy.limits
    auth = f"{len(keys)} API key(s) required" if keys else "none (no --api-key)"
    limit = options.request_timeout
    media = ["data:"]
    if policy.roots:
        media.append(f"file:// under {len(policy.roots)} root(s)")
    if policy.allow_remote:
        media.append("http(s) from public addresses")
    return [
        f"auth       {auth}",
        f"admin      {describe_admin(options.admin_keys, options.admin_routes)}",
        f"hosts      {options.allowed_hosts.describe() if options.allowed_hosts else 'any'}",
        f"chat page  {'at / (--ui off to turn it off)' if options.ui else 'off (--ui on)'}",
        f"mcp        {'tools at /mcp' if options.mcp_route else 'off (--mcp-route)'}",
        f"limits     body {options.max_body_bytes} bytes, "
        f"timeout {'none' if limit is None else f'{limit:g}s'}, "
        f"body within {'none' if options.body_timeout is None else f'{options.body_timeout:g}s'}",
        f"media      {', '.join(media)}; at most {policy.max_num_images} images, "
        f"{policy.max_num_audios} audio clips, {policy.max_num_videos} videos, "
        f"{policy.max_media_bytes} bytes each",
        f"decoding   images up to {lim.max_image_pixels} pixels{_edge(lim.max_image_edge)}; "
        "video up to "
        f"{lim.max_video_seconds:g} s and {lim.max_video_frames} frames; audio up to "
        f"{lim.max_audio_seconds:g} s at {lim.max_audio_sample_rate} Hz",
        *_describe_agent(options),
        *_describe_search(options),
    ]


def _edge(max_edge: int | None) -> str:
    return "" if max_edge is None else f", scaled to {max_edge} px on the long side (--max-edge)"


def _describe_agent(options: ServerOptions) -> list[str]:
    """The agent settings' line, when any is set (the tools themselves: cli's probe)."""
    agent = options.agent
    if not agent.has_sources and not agent.mcp_allow_urls:
        return []
    sources = [f"{len(agent.mcp_servers)} MCP server(s)"]
    if agent.dispatch_url is not None:
        sources.append("a dispatch URL")
    if agent.code_execution:
        sources.append("sandboxed code execution")
    if agent.skills_dir is not None:
        sources.append(f"skills from {agent.skills_dir}")
    named = f"{len(agent.mcp_allow_urls)} pattern(s)" if agent.mcp_allow_urls else "off"
    return [
        f"agent      {', '.join(sources)}; permission {agent.permission}; at most "
        f"{agent.max_tool_rounds} tool rounds; request-named MCP servers {named}"
    ]


def _describe_search(options: ServerOptions) -> list[str]:
    """The web search line, when a backend is set."""
    agent = options.agent
    if agent.search_dir is not None:
        rerank = agent.search_embedding_model
        order = f"bm25, reranked by {rerank}" if rerank else "bm25"
        return [f"search     the files under {agent.search_dir} ({order})"]
    if agent.search_url is not None:
        return [f"search     {agent.search_url}"]
    return []
