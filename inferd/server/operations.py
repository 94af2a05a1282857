"""Wiring of the operational layer: metrics, access log, auth, CORS, limits, docs, media policy.

Middleware, outermost first (RequestIdMiddleware, added by build_app, wraps them all):

    AccessLogMiddleware   every request counted, timed and logged, refused ones included
    HostMiddleware        only with an allow-list: any other Host gets 421 (crosssite.py)
    TransportMiddleware   body timeout (408), the connection cap's 503 (transport.py)
    DrainMiddleware       during shutdown 503 for new requests; cuts the rest (shutdown.py)
    CORSMiddleware        only with allowed origins; answers preflights before auth
    AdminMiddleware       lifecycle routes: admin keys, or off (404) (admin.py)
    AuthMiddleware        only with API keys; /health, /ready and the chat page stay open
    LimitsMiddleware      body size (413) and request timeout (408/504)
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from inferd.server.access_log import AccessLogMiddleware, PayloadLog
from inferd.server.admin import AdminMiddleware, is_admin_request
from inferd.server.auth import OPEN_PATHS, AuthMiddleware
from inferd.server.chat_page import PAGE_PATHS
from inferd.server.crosssite import HostMiddleware
from inferd.server.defaults import DEFAULT_MAX_BODY_BYTES
from inferd.server.limits import LimitsMiddleware
from inferd.server.metrics import ServerMetrics, metrics
from inferd.server.openapi import install_openapi
from inferd.server.options import ServerOptions
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


def docs_urls(docs: bool, base_path: str = "") -> dict[str, Any]:
    """FastAPI constructor arguments: ``base_path``/openapi.json, or nothing. FastAPI's /docs
    and /redoc pages are never served: they load Swagger UI's or ReDoc's JavaScript from a
    third-party CDN, unpinned, into the API's own origin (where the API key and the chat page
    live). The document is also at ``base_path``/api-doc/openapi.json (``install_openapi``),
    where mistral.rs serves it."""
    url = f"{base_path}/openapi.json" if docs else None
    return {"docs_url": None, "redoc_url": None, "openapi_url": url}


def install_operations(app: FastAPI, options: ServerOptions) -> None:
    """Add routes, state and middleware. Call before RequestIdMiddleware is added."""
    app.state.media_policy = options.media_policy
    app.state.lora_roots = options.lora_roots  # where /v1/load_lora_adapter may read
    server_metrics: ServerMetrics | None = None
    if options.metrics:
        server_metrics = ServerMetrics(app.state.inferd)
        app.state.server_metrics = server_metrics
        app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)
    if options.docs:
        install_openapi(app, auth_required=bool(options.api_keys), base_path=options.docs_base_path)
    # add_middleware puts each one outside those added before it.
    app.add_middleware(
        LimitsMiddleware,
        max_body_bytes=options.max_body_bytes,
        max_header_bytes=options.max_header_bytes,
        request_timeout=options.request_timeout,
    )
    if options.api_keys:
        open_paths = OPEN_PATHS
        if options.ui:  # the page asks for the key; the API calls it makes carry it
            open_paths |= PAGE_PATHS
        app.add_middleware(
            AuthMiddleware,
            api_keys=options.api_keys,
            open_paths=open_paths,
            # with admin keys, the admin actions are the admin guard's alone
            open_when=is_admin_request if options.admin_keys else None,
        )
    app.add_middleware(AdminMiddleware, admin_keys=options.admin_keys, enabled=options.admin_routes)
    if options.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(options.allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=list(CORS_HEADERS),
            expose_headers=["x-request-id", "retry-after"],
            max_age=600,
        )
    app.state.drain = Drain()
    app.add_middleware(DrainMiddleware, drain=app.state.drain)
    app.add_middleware(TransportMiddleware, body_timeout=options.body_timeout)
    if options.allowed_hosts is not None:
        app.add_middleware(HostMiddleware, allowed=options.allowed_hosts)
    payload_log = None
    if options.log_payloads is not None:
        limit = options.max_body_bytes or DEFAULT_MAX_BODY_BYTES
        payload_log = PayloadLog(options.log_payloads, limit)
        log.warning(
            "--log-payloads: request bodies, which hold prompts and media, are written to %s",
            options.log_payloads,
        )
    app.add_middleware(
        AccessLogMiddleware,
        router=app.router,
        metrics=server_metrics,
        log_format=options.access_log_format,
        payload_log=payload_log,
    )
