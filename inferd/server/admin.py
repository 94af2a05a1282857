"""The model-lifecycle routes (POST /v1/models/unload, reload, status, /re_isq, and the
/calibration routes), the LoRA adapter routes (POST /v1/load_lora_adapter,
/v1/unload_lora_adapter) and the changes to skills (POST /v1/skills, DELETE /v1/skills/{id})
are admin actions.

Unloading a model stops service for every user, a reload costs a full load, a re-quantization
changes every user's answers (and a calibration's chunks hold up everyone's steps), and a skill
is text every user's agent loop may read as instructions, so these routes are guarded apart
from the API:

- with admin keys (``--admin-key``, ``INFERD_ADMIN_KEYS``) they take only an admin key, sent
  like an API key (``Authorization: Bearer`` or ``x-api-key``); API keys do not open them, and
  admin keys do not open the rest of the API;
- without admin keys they follow the API's own rule (open, or ``--api-key``), unless the routes
  are off: ``inferd serve`` turns them off (404) when it binds a non-loopback address with no
  admin key, as anyone who reaches that address could otherwise unload the models.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from inferd.server.auth import AuthMiddleware
from inferd.server.envelope import app_path, error_response

LIFECYCLE_ROUTES = (
    "/v1/models/unload",
    "/v1/models/reload",
    "/v1/models/status",
    "/v1/re_isq",
    "/v1/calibration/start",
    "/v1/calibration/status",
    "/v1/calibration/apply",
    "/v1/calibration/imatrix",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
)
ADMIN_PATHS = frozenset([*LIFECYCLE_ROUTES, *(p.removeprefix("/v1") for p in LIFECYCLE_ROUTES)])
SKILLS_PATHS = ("/v1/skills", "/skills")  # and what is under them


def is_admin_request(scope: Mapping[str, Any]) -> bool:
    """Whether a request is an admin action: a lifecycle route, or a change to the skills
    (reading them is the API's)."""
    path = app_path(scope)
    if path in ADMIN_PATHS:
        return True
    if scope.get("method") in ("GET", "HEAD", "OPTIONS"):
        return False
    return any(path == p or path.startswith(p + "/") for p in SKILLS_PATHS)


class AdminMiddleware:
    def __init__(self, app: ASGIApp, *, admin_keys: Sequence[str], enabled: bool) -> None:
        self.app = app
        self.enabled = enabled
        self.guard: ASGIApp = app
        if admin_keys:
            self.guard = AuthMiddleware(
                app, api_keys=admin_keys, open_paths=(), key_name="admin key"
            )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_admin_request(scope):
            await self.app(scope, receive, send)
        elif not self.enabled:
            message = (
                f"no route {scope['method']} {app_path(scope)}: the model lifecycle routes are "
                "off on a non-loopback address without --admin-key (or with --admin-routes off)"
            )
            await error_response(scope, 404, message)(scope, receive, send)
        else:
            await self.guard(scope, receive, send)


def describe(admin_keys: Sequence[str], enabled: bool) -> str:
    """The startup line's account of the lifecycle routes."""
    if not enabled:
        return "lifecycle routes off (non-loopback bind, no --admin-key)"
    if admin_keys:
        return f"lifecycle routes need one of {len(admin_keys)} admin key(s)"
    return "lifecycle routes follow the API's auth (no --admin-key)"
