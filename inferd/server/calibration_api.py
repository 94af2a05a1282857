"""The calibration routes (mistral.rs's): an importance matrix made by the running server from
a text, then the model re-quantized for it. Admin routes, guarded like /re_isq (server/admin.py).

    POST /calibration/start   {"model"?, "text", "chunk_size"? (512), "chunks"?, "dataset"?}
    GET  /calibration/status  ?model=
    POST /calibration/apply   {"model"?, "isq"? | "ggml_type"?, "drain_timeout"?,
                               "save_imatrix"? (a name in the store)}
    GET  /calibration/imatrix ?model=   the matrix as llama.cpp's GGUF imatrix file

``start`` cuts the text into chunks as ``inferd imatrix`` does and runs them through the model
between engine steps while it serves on (serving/calibration.py): it answers at once, state
``running``; ``status`` follows it to ``done`` (with the matrix's digest) or ``failed``.
mistral.rs's start takes no text and observes live traffic; inferd calibrates on the text it is
sent (a bodiless ``{}`` is a 400 saying so), so the matrix is reproducible. ``apply``
re-quantizes the model for the finished matrix exactly as /re_isq re-quantizes (the weights
from the model's files, drained, swapped between two steps, the caches cleared): with ``isq``
(``q8`` | ``q4``) or mistral.rs's ``ggml_type``, or neither, as mistral.rs's ``{}``, for the
model's current method. Afterwards /v1/models shows the ``quantization`` and the ``imatrix``
digest, and /re_isq to another method keeps the matrix.

Every answer is the calibration's status: ``{"object": "calibration", "model_id", "state",
"chunks_done", "chunks_total", "chunk_size", "tokens", "dataset", "imatrix"?, "error"?}`` plus
mistral.rs's ``CalibrationStatus`` fields (``collecting``, ``layers``, ``layers_tracking``,
``total_rows``, ``min_rows``, ``max_rows``); ``apply`` adds /re_isq's answer (``status``,
``quantization``, ``previous``, ``changed``, ...) and ``saved_imatrix``. 400 for a bad body,
a missing, oversized or too short text, a chunk longer than the context, an embedding model or
a LoRA adapter; 404 for an unknown model; 409, nothing changed, to start while the model
calibrates or re-quantizes, to apply or download before a calibration is done, and as /re_isq.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from inferd.server.errors import APIError
from inferd.server.protocol import parse_body
from inferd.server.requantize_api import (
    ReIsqRequest,
    card,
    requantizable,
    requested_method,
    swapped,
)
from inferd.server.state import ServerState, lifecycle_error
from inferd.serving.calibration import (
    Calibration,
    idle_status,
    imatrix_gguf,
    save_imatrix,
    store_imatrix_path,
)
from inferd.serving.interface import DEFAULT_CHUNK_SIZE, ImatrixError
from inferd.serving.registry import ConflictError, ModelSlot
from inferd.serving.served import ServedModel

# The most text one calibration reads (characters): about a million tokens, hours of prefill on
# a CPU; `inferd imatrix` reads files of any size.
MAX_CALIBRATION_CHARS = 4 << 20


class CalibrationStartRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = Field(default=None, min_length=1)
    text: str | None = Field(default=None, max_length=MAX_CALIBRATION_CHARS)
    chunk_size: int = Field(default=DEFAULT_CHUNK_SIZE, ge=1)
    chunks: int | None = Field(default=None, ge=1)  # at most this many (whole ones)
    dataset: str = Field(default="", max_length=256)


class CalibrationApplyRequest(ReIsqRequest):
    save_imatrix: str | None = Field(default=None, min_length=1, max_length=128)
    save_cimatrix: str | None = None  # mistral.rs's own format: refused, saying what to use


async def calibration_start(request: Request) -> Response:
    state: ServerState = request.app.state.inferd
    body = parse_body(await request.body(), CalibrationStartRequest)
    if not body.text:
        raise APIError(
            400,
            "send the calibration text as text (inferd calibrates on a text it is given, read "
            "in chunks of chunk_size tokens; it does not observe live traffic)",
            "text",
        )
    slot = state.slot(body.model)
    requantizable(slot)
    try:
        calibration = await slot.calibrate(
            body.text, chunk_size=body.chunk_size, max_chunks=body.chunks, dataset=body.dataset
        )
    except ImatrixError as exc:
        raise APIError(400, str(exc), "text", "invalid_calibration") from None
    except ConflictError as exc:
        raise lifecycle_error(exc) from None
    return JSONResponse(_answer(slot, calibration.status()))


async def calibration_status(request: Request) -> Response:
    slot = _slot(request)
    model = slot.model
    calibration = model.calibration if isinstance(model, ServedModel) else None
    status = idle_status() if calibration is None else calibration.status()
    return JSONResponse(_answer(slot, status))


async def calibration_apply(request: Request) -> Response:
    state: ServerState = request.app.state.inferd
    body = parse_body(await request.body(), CalibrationApplyRequest)
    if body.save_cimatrix is not None:
        raise APIError(
            400,
            "save_cimatrix is mistral.rs's own file format; save_imatrix NAME keeps llama.cpp's "
            "GGUF imatrix in the store, and GET /calibration/imatrix downloads it",
            "save_cimatrix",
        )
    slot = state.slot(body.model)
    model = requantizable(slot)
    calibration = _finished(slot, model)
    imatrix = calibration.imatrix
    assert imatrix is not None
    method = requested_method(body, default=model.isq)
    path = None
    if body.save_imatrix is not None:
        try:
            path = store_imatrix_path(body.save_imatrix)
        except ImatrixError as exc:
            raise APIError(400, str(exc), "save_imatrix") from None
        await asyncio.to_thread(save_imatrix, imatrix, path, model.config.architecture)
    out = _answer(slot, calibration.status())
    if path is not None:
        out["saved_imatrix"] = str(path)
    if body.ggml_type is not None:
        out["ggml_type"] = body.ggml_type
    current = model.imatrix.digest() if model.imatrix is not None else None
    if (model.isq, current) == (method, imatrix.digest()):
        return JSONResponse(out | card(slot, model) | {"previous": method, "changed": False})
    timeout = state.registry.drain_timeout if body.drain_timeout is None else body.drain_timeout
    try:
        report = await slot.requantize(method, timeout, imatrix)
    except ConflictError as exc:
        raise lifecycle_error(exc) from None
    return JSONResponse(out | card(slot, model) | swapped(report))


async def calibration_imatrix(request: Request) -> Response:
    slot = _slot(request)
    model = requantizable(slot)
    imatrix = _finished(slot, model).imatrix
    assert imatrix is not None
    data = await asyncio.to_thread(imatrix_gguf, imatrix, model.config.architecture)
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in slot.id)
    return Response(
        data,
        media_type="application/octet-stream",
        headers={"content-disposition": f'attachment; filename="{name}.imatrix.gguf"'},
    )


def _slot(request: Request) -> ModelSlot:
    """The base chat model a GET names (``?model=``; the default one without)."""
    state: ServerState = request.app.state.inferd
    slot = state.slot(request.query_params.get("model") or None)
    if slot.kind != "chat":
        raise APIError(400, f"the model {slot.id!r} is an embedding model: it has no ISQ", "model")
    if slot.parent is not None:
        raise APIError(400, f"{slot.id!r} is a LoRA adapter: calibrate {slot.parent.id!r}", "model")
    return slot


def _finished(slot: ModelSlot, model: ServedModel) -> Calibration:
    """The model's finished calibration; 409 when there is none."""
    calibration = model.calibration
    if calibration is None or calibration.imatrix is None:
        state = "idle" if calibration is None else str(calibration.state)
        raise APIError(
            409,
            f"the model {slot.id!r} has no finished calibration (it is {state}): POST "
            "/calibration/start, then wait for GET /calibration/status to say done",
            "model",
            "calibration_not_done",
        )
    return calibration


def _answer(slot: ModelSlot, status: dict[str, Any]) -> dict[str, Any]:
    return {"object": "calibration", "model_id": slot.id} | status
