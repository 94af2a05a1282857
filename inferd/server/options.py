"""ServerOptions: every setting of the HTTP server, in one frozen value.

Built once, by `inferd serve` from its flags (``serve_args.server_options``) or by an embedding
app (``build_app(models, ServerOptions(api_keys=("...",)))``), and validated here whichever
built it. Each field is one `inferd serve` flag of the same name (``--max-body-bytes`` is
``max_body_bytes``), so adding a setting is a field here plus a flag in serve_args.py; a flag
whose dest is a field's name needs no translation. Errors name the flag, as a CLI user and an
embedder both find it in ``inferd serve --help``.

The defaults are the safe choice: no API keys means open (bind to loopback), 16 MiB bodies,
16 KiB heads, no CORS, no payload logging, no file or remote media.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from inferd.agent.config import AgentConfig
from inferd.server.auth import validate_keys
from inferd.server.crosssite import HostAllowList
from inferd.server.defaults import (
    ACCESS_LOG_FORMATS,
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_FILES_TOTAL_BYTES,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_LOGPROBS_TOKENS,
)
from inferd.server.media import MediaPolicy
from inferd.server.reasoning import PARSERS
from inferd.server.responses_store import DEFAULT_TTL_SECONDS, MEMORY
from inferd.serving.args import DEFAULT_DRAIN_TIMEOUT


@dataclass(frozen=True, slots=True)
class ServerOptions:
    # -- the models (used when build_app is given models; a ModelRegistry carries its own)
    default_model: str | None = None  # answers model "default" or none (else the first loaded)
    auto_reload: bool = True  # a request for an unloaded model reloads it (else 503)
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT  # seconds unloading waits for running requests
    # -- security and limits
    api_keys: tuple[str, ...] = ()  # required on every route but /health and /ready
    allowed_origins: tuple[str, ...] = ()  # CORS; "*" or http(s)://host[:port]
    max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES  # larger bodies get 413
    max_header_bytes: int | None = DEFAULT_MAX_HEADER_BYTES  # larger heads get 431
    request_timeout: float | None = None  # seconds; 408 while reading the body, 504 after
    # (token, logprob) pairs one completions response may carry; more gets 400
    max_logprobs_tokens: int = DEFAULT_MAX_LOGPROBS_TOKENS
    body_timeout: float | None = DEFAULT_BODY_TIMEOUT  # seconds for a body (transport.py)
    # None: no Host check (an embedder's names are its own); `inferd serve` always sets it.
    # Given (HostAllowList.of(names)): other Hosts get 421 (crosssite.py).
    allowed_hosts: HostAllowList | None = None
    admin_keys: tuple[str, ...] = ()  # given: the lifecycle routes take only these keys
    admin_routes: bool = True  # False: the lifecycle routes answer 404 (admin.py)
    # -- observability
    access_log_format: str | None = "text"  # text | json | None (off)
    log_payloads: Path | None = None  # request bodies as JSON lines (debugging only)
    metrics: bool = True  # GET /metrics
    docs: bool = True  # /openapi.json (no /docs page: see operations.docs_urls)
    docs_base_path: str = ""  # a prefix for the document's routes, e.g. "/internal"
    # -- the chat page at / (chat_page.py); `inferd serve` turns it on when bound to loopback
    ui: bool = False
    # -- the models as MCP tools at /mcp (streamable HTTP, mcp_server.py), behind the API key
    mcp_route: bool = False
    # -- streams
    keepalive_seconds: float = 5.0  # an SSE comment after this long without an event
    # -- prompts
    # Special-token text inside message content makes control tokens (off: read as plain text,
    # so content cannot forge turns; only the chat template makes control tokens).
    allow_special_tokens_in_content: bool = False
    # -- replies: split <think> reasoning from the answer (auto: when the template mentions it;
    # think: always; none: never) (server/reasoning.py)
    reasoning_parser: str = "auto"
    # -- stored responses (/v1/responses): an SQLite file, or ":memory:" (`inferd serve`
    # defaults to a file under INFERD_HOME), and how long a stored response lives
    responses_store: str = MEMORY
    responses_ttl: float = DEFAULT_TTL_SECONDS
    # -- /v1/files: the folder of the file store (None: a private temporary folder; `inferd
    # serve` puts it beside the responses store), the limit per file and for all together
    files_dir: str | None = None
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    max_files_total_bytes: int = DEFAULT_MAX_FILES_TOTAL_BYTES
    # -- media in requests
    media_policy: MediaPolicy = field(default_factory=MediaPolicy)
    # -- LoRA adapters loaded at runtime (POST /v1/load_lora_adapter) only from under these
    # directories; none: runtime loading is refused (--lora at startup is not limited)
    lora_roots: tuple[Path, ...] = ()
    # -- server-side tools for the agent loop (--mcp-config, --tool-dispatch-url, ...: agent/)
    agent: AgentConfig = field(default_factory=AgentConfig)

    def __post_init__(self) -> None:
        # Sequences given as lists are kept as tuples, so the value stays immutable.
        object.__setattr__(self, "api_keys", validate_keys(self.api_keys))
        object.__setattr__(self, "admin_keys", validate_keys(self.admin_keys))
        object.__setattr__(self, "allowed_origins", validate_origins(self.allowed_origins))
        if self.log_payloads is not None:
            object.__setattr__(self, "log_payloads", Path(self.log_payloads))
        if self.max_body_bytes is not None and self.max_body_bytes < 1:
            raise ValueError("--max-body-bytes must be at least 1")
        if self.max_header_bytes is not None and self.max_header_bytes < 1024:
            raise ValueError("--max-header-bytes must be at least 1024")
        if self.reasoning_parser not in PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(PARSERS)}")
        if self.max_logprobs_tokens < 1:
            raise ValueError("--max-logprobs-tokens must be at least 1")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError("--request-timeout must be positive")
        if self.body_timeout is not None and not self.body_timeout > 0:
            raise ValueError("--body-timeout must be positive")
        if not self.drain_timeout >= 0:
            raise ValueError("--drain-timeout must not be negative")
        if not self.keepalive_seconds > 0:
            raise ValueError("keepalive_seconds must be positive")
        if not self.responses_ttl > 0:
            raise ValueError("--responses-ttl must be positive")
        object.__setattr__(self, "responses_store", str(self.responses_store))
        if self.max_file_bytes < 1:
            raise ValueError("--max-file-bytes must be at least 1")
        if self.max_files_total_bytes < self.max_file_bytes:
            raise ValueError("--max-files-total-bytes must be at least --max-file-bytes")
        object.__setattr__(self, "lora_roots", validate_roots(self.lora_roots, "--lora-root"))
        if self.access_log_format not in (None, *ACCESS_LOG_FORMATS):
            raise ValueError(f"access log format must be one of {', '.join(ACCESS_LOG_FORMATS)}")


def validate_origins(origins: Sequence[str]) -> tuple[str, ...]:
    if isinstance(origins, str):
        raise ValueError("allowed origins must be a sequence of origins, not one string")
    for origin in origins:
        if origin != "*" and not origin.startswith(("http://", "https://")):
            raise ValueError(f"allowed origin {origin!r} must be http(s)://host[:port]")
    return tuple(origins)


def validate_roots(roots: Sequence[str | Path], flag: str) -> tuple[Path, ...]:
    """Directories as absolute, normalized paths (symlinks kept: a path checked against one
    is checked as written and again resolved); each must exist."""
    if isinstance(roots, str | Path):
        raise ValueError(f"{flag} must be a sequence of directories, not one path")
    out = []
    for raw in roots:
        given = Path(os.path.normpath(os.path.abspath(os.fspath(raw))))
        if not given.is_dir():
            raise ValueError(f"{flag} {raw}: not an existing directory")
        out.append(given)
    return tuple(out)
