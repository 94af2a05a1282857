"""Runtime LoRA adapters (admin routes, guarded like the model lifecycle: server/admin.py).

POST /v1/load_lora_adapter    {"lora_name", "lora_path"} -> reads and checks the adapter on
                              a worker thread, registers it on the default model (attached
                              when a request needs it, --max-loras) and lists it as its own
                              model; 400 naming it when it cannot be served, for a name
                              that is not an identifier, and for a path not under a
                              --lora-root (all of runtime loading without one), 409 when
                              the name is taken
POST /v1/unload_lora_adapter  {"lora_name"} -> stops listing it, waits (--drain-timeout) for
                              the requests running at that moment, then forgets it
                              (detached if resident); 404 for no such adapter, 409 (still
                              listed) when they do not finish
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from inferd.server.errors import APIError
from inferd.server.protocol import parse_body
from inferd.server.state import ServerState
from inferd.serving.interface import LoraError, check_name
from inferd.serving.lora import adapter_slot, serve_adapters, withdraw_adapter
from inferd.serving.served import ServedModel

DRAIN_POLL_SECONDS = 0.05


class LoadAdapter(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadAdapter(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    lora_name: str = Field(min_length=1, max_length=256)


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.inferd
    return state


async def load_lora_adapter(request: Request) -> Response:
    state = _state(request)
    body = parse_body(await request.body(), LoadAdapter)
    name = body.lora_name
    try:
        check_name(name)
    except LoraError as exc:
        raise APIError(400, str(exc), "lora_name", "invalid_lora_name") from None
    path = adapter_path(body.lora_path, getattr(request.app.state, "lora_roots", ()))
    if name == "default" or name in state.registry.slots:
        raise APIError(409, f"the model id {name!r} is taken", "lora_name", "model_exists")
    base_slot = state.slot(None)
    base = state.resolve_model(None)
    if base.lora is not None:
        raise APIError(400, "the default model is itself an adapter", "lora_name")
    try:
        views = await asyncio.to_thread(serve_adapters, base, [(name, path)], base.max_lora_rank)
    except ValueError as exc:  # LoraError included: it names the adapter and the reason
        raise APIError(400, str(exc), "lora_path", "invalid_lora_adapter") from None
    winner = state.registry.slots.get(name)
    if winner is not None:  # a concurrent load of the same name won
        if getattr(winner.model, "lora", None) != views[0].lora:  # not the same files
            withdraw_adapter(views[0])
        raise APIError(409, f"the model id {name!r} is taken", "lora_name", "model_exists")
    state.registry.add(adapter_slot(base_slot, name, path, base.max_lora_rank, views[0]))
    return JSONResponse({"id": name, "object": "model", "parent": base.id})


def adapter_path(raw: str, roots: tuple[Path, ...]) -> Path:
    """The adapter directory ``raw`` names, once it is known to lie under a --lora-root: an
    absolute path without ``..``, under a root as written and again with symlinks resolved
    (as server/media.py checks file:// media). Every path outside gets the same answer,
    whether or not it exists: nothing outside the roots is looked at before the check."""
    if not roots:
        raise APIError(
            400,
            "loading LoRA adapters at runtime is off on this server (start it with "
            "--lora-root DIR to allow adapters under DIR)",
            "lora_path",
            "lora_path_refused",
        )
    outside = APIError(
        400,
        "lora_path must be an absolute path under a --lora-root directory of this server",
        "lora_path",
        "lora_path_refused",
    )
    if "\x00" in raw or not raw.startswith("/") or ".." in raw.split("/"):
        raise outside
    lexical = Path(os.path.normpath(raw))
    real_roots = [Path(os.path.realpath(root)) for root in roots]
    if not any(lexical.is_relative_to(root) for root in (*roots, *real_roots)):
        raise outside
    real = Path(os.path.realpath(lexical))
    if not any(real.is_relative_to(root) for root in real_roots):
        raise outside
    return real


async def unload_lora_adapter(request: Request) -> Response:
    state = _state(request)
    body = parse_body(await request.body(), UnloadAdapter)
    name = body.lora_name
    slot = state.registry.slots.get(name)
    view = slot.model if slot is not None else None
    if slot is not None and slot.parent is not None and not isinstance(view, ServedModel):
        state.registry.remove(name)  # not on any engine now (failed, or its base unloaded)
        return JSONResponse({"id": name, "object": "model", "deleted": True})
    if slot is None or not isinstance(view, ServedModel) or view.lora is None:
        raise APIError(404, f"no LoRA adapter {name!r} is loaded", "lora_name", "model_not_found")
    state.registry.remove(name)  # no new request reaches it from here on
    running = set(view.engine.in_flight())
    deadline = time.monotonic() + state.registry.drain_timeout
    while running & set(view.engine.in_flight()):
        if time.monotonic() > deadline:
            state.registry.add(slot)
            raise APIError(
                409, f"requests still run on the engine of {name!r}; try again", "lora_name"
            )
        await asyncio.sleep(DRAIN_POLL_SECONDS)
    withdraw_adapter(view)
    return JSONResponse({"id": name, "object": "model", "deleted": True})
