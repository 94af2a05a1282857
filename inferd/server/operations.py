"""Wiring of the operational layer: metrics, access log, auth, CORS, limits, docs, media policy.

Middleware, outermost first (RequestIdMiddleware, added by build_app, wraps them all):

    AccessLogMiddleware   every request counted, timed and logged, refused ones included
    HostMiddleware        only with an allow-list: any other Host gets 421 (crosssite.py)
    TransportMiddleware   body timeout (408), the connection cap's 503 (transport.py)
    DrainMiddleware       during shutdown 503 for new requests; cuts the rest (shutdown.py)
    CORSMiddleware        only with allowed origins; answers preflights before auth
    AdminMiddleware       lifecycle routes: admin keys, or off (404) (admin.py)
    AuthMiddleware        only with API keys; /health stays open
    LimitsMiddleware      body size (413) and request timeout (408/504)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from inferd.server.access_log import LOG_FORMATS, AccessLogMiddleware, PayloadLog
from inferd.server.admin import ADMIN_PATHS, AdminMiddleware
from inferd.server.auth import OPEN_PATHS, AuthMiddleware, validate_keys
from inferd.server.crosssite import HostAllowList, HostMiddleware
from inferd.server.defaults import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_HEADER_BYTES,
)
from inferd.server.limits import LimitsMiddleware
from inferd.server.media import MediaPolicy
from inferd.server.metrics import ServerMetrics, metrics
from inferd.server.openapi import install_openapi
from inferd.server.serve_args import validate_origins
from inferd.server.shutdown import Drain, DrainMiddleware
from inferd.server.transport import TransportMiddleware

log = logging.getLogger("inferd")

CORS_HEADERS = (
    "authorization",
    "x-api-key",
    "content-type",
    "anthropic-version",
    "anthropic-beta",
    "x-request-id",
    "openai-organization",
    "openai-project",
    "x-stainless-arch",
    "x-stainless-lang",
    "x-stainless-os",
    "x-stainless-package-version",
    "x-stainless-retry-count",
    "x-stainless-runtime",
    "x-stainless-runtime-version",
    "x-stainless-timeout",
)


@dataclass(frozen=True, slots=True)
class Operations:
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES
    max_header_bytes: int | None = DEFAULT_MAX_HEADER_BYTES
    request_timeout: float | None = None
    allowed_origins: tuple[str, ...] = ()
    access_log_format: str | None = "text"
    log_payloads: Path | None = None
    metrics: bool = True
    docs: bool = True
    media_policy: MediaPolicy = field(default_factory=MediaPolicy)
    # None: no Host check (an embedder's names are its own); `inferd serve` always sets it
    allowed_hosts: HostAllowList | None = None
    admin_keys: tuple[str, ...] = ()  # given: the lifecycle routes take only these keys
    admin_routes: bool = True  # False: the lifecycle routes answer 404
    body_timeout: float | None = DEFAULT_BODY_TIMEOUT  # seconds, see transport.py

    def __post_init__(self) -> None:
        validate_keys(self.api_keys)
        validate_keys(self.admin_keys)
        if self.body_timeout is not None and self.body_timeout <= 0:
            raise ValueError("the body timeout must be positive")
        if self.access_log_format not in (None, *LOG_FORMATS):
            raise ValueError(f"access log format must be one of {', '.join(LOG_FORMATS)}")
        validate_origins(self.allowed_origins)


def docs_urls(docs: bool) -> dict[str, Any]:
    """FastAPI constructor arguments: /docs and /openapi.json, or neither."""
    if docs:
        return {"docs_url": "/docs", "redoc_url": None, "openapi_url": "/openapi.json"}
    return {"docs_url": None, "redoc_url": None, "openapi_url": None}


def install_operations(app: FastAPI, ops: Operations) -> None:
    """Add routes, state and middleware. Call before RequestIdMiddleware is added."""
    app.state.media_policy = ops.media_policy
    server_metrics: ServerMetrics | None = None
    if ops.metrics:
        server_metrics = ServerMetrics()
        app.state.server_metrics = server_metrics
        app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)
    if ops.docs:
        install_openapi(app, auth_required=bool(ops.api_keys))
    # add_middleware puts each one outside those added before it.
    app.add_middleware(
        LimitsMiddleware,
        max_body_bytes=ops.max_body_bytes,
        max_header_bytes=ops.max_header_bytes,
        request_timeout=ops.request_timeout,
    )
    if ops.api_keys:
        # with admin keys, the lifecycle routes are the admin guard's alone
        open_paths = OPEN_PATHS | ADMIN_PATHS if ops.admin_keys else OPEN_PATHS
        app.add_middleware(AuthMiddleware, api_keys=ops.api_keys, open_paths=open_paths)
    app.add_middleware(AdminMiddleware, admin_keys=ops.admin_keys, enabled=ops.admin_routes)
    if ops.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(ops.allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=list(CORS_HEADERS),
            expose_headers=["x-request-id", "retry-after"],
            max_age=600,
        )
    app.state.drain = Drain()
    app.add_middleware(DrainMiddleware, drain=app.state.drain)
    app.add_middleware(TransportMiddleware, body_timeout=ops.body_timeout)
    if ops.allowed_hosts is not None:
        app.add_middleware(HostMiddleware, allowed=ops.allowed_hosts)
    payload_log = None
    if ops.log_payloads is not None:
        payload_log = PayloadLog(ops.log_payloads, ops.max_body_bytes or DEFAULT_MAX_BODY_BYTES)
        log.warning(
            "--log-payloads: request bodies, which hold prompts and media, are written to %s",
            ops.log_payloads,
        )
    app.add_middleware(
        AccessLogMiddleware,
        router=app.router,
        metrics=server_metrics,
        log_format=ops.access_log_format,
        payload_log=payload_log,
    )


def operations(
    *,
    api_keys: Sequence[str] = (),
    max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES,
    max_header_bytes: int | None = DEFAULT_MAX_HEADER_BYTES,
    request_timeout: float | None = None,
    allowed_origins: Sequence[str] = (),
    access_log_format: str | None = "text",
    log_payloads: str | Path | None = None,
    metrics: bool = True,
    docs: bool = True,
    media_policy: MediaPolicy | None = None,
    allowed_hosts: HostAllowList | Sequence[str] | None = None,
    admin_keys: Sequence[str] = (),
    admin_routes: bool = True,
    body_timeout: float | None = DEFAULT_BODY_TIMEOUT,
) -> Operations:
    if allowed_hosts is not None and not isinstance(allowed_hosts, HostAllowList):
        allowed_hosts = HostAllowList.of(allowed_hosts)
    return Operations(
        api_keys=tuple(api_keys),
        max_body_bytes=max_body_bytes,
        max_header_bytes=max_header_bytes,
        request_timeout=request_timeout,
        allowed_origins=tuple(allowed_origins),
        access_log_format=access_log_format,
        log_payloads=None if log_payloads is None else Path(log_payloads),
        metrics=metrics,
        docs=docs,
        media_policy=media_policy or MediaPolicy(),
        allowed_hosts=allowed_hosts,
        admin_keys=tuple(admin_keys),
        admin_routes=admin_routes,
        body_timeout=body_timeout,
    )
