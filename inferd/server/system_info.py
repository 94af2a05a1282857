"""``GET /v1/system/info``: ``inferd doctor``'s facts for the running server, plus its models
(with the kernels and dtype each one really uses) and its uptime. ``GET /v1/system/tune``:
``inferd tune --json`` for a loaded model (``?model=ID``, the default model when not given),
with the settings it runs under now beside the estimate."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from inferd.server.state import ServerState
from inferd.serving.kernel_use import kernel_use
from inferd.serving.registry import ModelSlot
from inferd.serving.served import ServedModel


def _model_info(slot: ModelSlot) -> dict[str, Any]:
    info: dict[str, Any] = {"id": slot.id, "kind": slot.kind, "status": str(slot.status)}
    model = slot.model
    if isinstance(model, ServedModel):
        info |= {
            "architecture": model.config.architecture,
            "dtype": str(model.dtype).removeprefix("torch."),
            "isq": model.isq,
            "digest": f"sha256:{model.source.digest}",
            "revision": model.source.revision,
            "kv_cache_tokens": model.kv_cache_tokens,
            "kv_cache_dtype": model.kv_cache_dtype,
            "max_seqs": model.engine_config.max_num_seqs,
            "deterministic": model.engine_config.deterministic,
            "kernels": kernel_use(model),
        }
    elif model is not None:
        info["digest"] = f"sha256:{model.source.digest}"
    return info


async def system_info(request: Request) -> Response:
    from inferd.doctor import collect

    state: ServerState = request.app.state.inferd
    info = await asyncio.to_thread(collect)  # reads /proc and the store's manifests
    info["server"] = {
        "uptime_s": round(time.time() - state.started, 1) if state.started else None,
        "default_model": state.registry.default_id,
        "models": [_model_info(s) for s in state.registry.slots.values()],
    }
    return JSONResponse(info)


async def system_tune(request: Request) -> Response:
    from inferd.tune import model_shape, recommend

    state: ServerState = request.app.state.inferd
    model = state.resolve_model(request.query_params.get("model"))
    shape = await asyncio.to_thread(model_shape, str(model.source.path))  # reads the header
    cfg = model.engine_config
    rec = recommend(shape, kv_cache_dtype=cfg.kv_cache_dtype)
    rec["model"]["source"] = model.id  # the id it is served under, not a path on this host
    rec["running"] = {
        "dtype": str(model.dtype).removeprefix("torch."),
        "isq": model.isq,
        "max_seqs": cfg.max_num_seqs,
        "max_seq_len": model.engine.max_model_len,
        "kv_cache_tokens": model.kv_cache_tokens,
        "kv_cache_dtype": model.kv_cache_dtype,
        "block_size": cfg.block_size,
    }
    return JSONResponse(rec)
