"""POST /re_isq (also /v1/re_isq): re-quantize a loaded model in place (mistral.rs's route; an
admin route, guarded like the model lifecycle: server/admin.py).

    {"model"?, "isq": "q8" | "q4", "drain_timeout"?}   inferd's body
    {"ggml_type": "Q4K"}                               mistral.rs's body (the default model)

mistral.rs's names map onto what inferd serves (loading/quantize.py ``MISTRALRS_ISQ_NAMES``):
``8``, ``Q8_0``, ``Q8_1``, ``Q8K`` -> q8; ``4``, ``Q4_0``, ``Q4_1``, ``Q4K`` -> q4; any other
name is a 400 naming these. The weights come from the model's files, quantized as a load under
``--isq`` quantizes them (a GGUF's blocks dequantized first; an ISQ'd model's source, not its
current rounding), while the model serves on; then new requests wait while the running ones
finish (up to ``drain_timeout``, by default ``--drain-timeout``) and the weights are swapped
between two engine steps, the prefix cache forgotten (serving/registry.py). A model quantized
for an importance matrix (``--imatrix``, or a calibration applied: calibration_api.py) is
quantized for the same matrix again. Answers once done:

    {"model_id", "object": "model", "status", "quantization", "imatrix"? ("sha256:..."),
     "previous", "changed", "drained", "seconds", "weight_bytes", "ggml_type"? (as sent)}

The model's current method answers at once with ``"changed": false``. 400 for a bad body, an
unknown method, an embedding model or a LoRA adapter (re-quantize its base); 404 for an unknown
model; 409, the model serving on as it was, when it is not loaded, is being re-quantized or
calibrated, cannot re-read its files, or still runs a request at the drain deadline.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from inferd.server.errors import APIError
from inferd.server.protocol import parse_body
from inferd.server.state import ServerState, lifecycle_error
from inferd.serving.interface import QuantizeError, isq_method
from inferd.serving.registry import ConflictError, ModelSlot, RequantizeReport
from inferd.serving.served import ServedModel


class ReIsqRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = Field(default=None, min_length=1)
    isq: str | None = Field(default=None, min_length=1, max_length=64)
    ggml_type: str | None = Field(default=None, min_length=1, max_length=64)
    drain_timeout: float | None = Field(default=None, ge=0, le=3600)


async def re_isq(request: Request) -> Response:
    state: ServerState = request.app.state.inferd
    body = parse_body(await request.body(), ReIsqRequest)
    method = requested_method(body)
    slot = state.slot(body.model)
    model = requantizable(slot)
    out: dict[str, Any] = {"model_id": slot.id, "object": "model"}
    if body.ggml_type is not None:
        out["ggml_type"] = body.ggml_type  # mistral.rs answers with the type it was sent
    if model.isq == method:
        return JSONResponse(card(slot, model) | out | {"previous": method, "changed": False})
    timeout = state.registry.drain_timeout if body.drain_timeout is None else body.drain_timeout
    try:
        report = await slot.requantize(method, timeout)
    except ConflictError as exc:
        raise lifecycle_error(exc) from None
    return JSONResponse(card(slot, model) | out | swapped(report))


def swapped(report: RequantizeReport) -> dict[str, Any]:
    """What an answer says of a swap made."""
    return {
        "previous": report.change.previous,
        "changed": True,
        "drained": report.drained,
        "seconds": round(report.seconds, 3),
    }


def requested_method(body: ReIsqRequest, default: str | None = None) -> str:
    """Our method from ``isq`` or ``ggml_type``: one of them given, or neither where there is
    a ``default``."""
    if body.isq is None and body.ggml_type is None and default is not None:
        return default
    if (body.isq is None) == (body.ggml_type is None):
        raise APIError(
            400, "give the quantization in one of isq (q8 | q4) or ggml_type (mistral.rs's)", "isq"
        )
    param, name = ("isq", body.isq) if body.isq is not None else ("ggml_type", body.ggml_type)
    assert name is not None
    try:
        return isq_method(name)
    except QuantizeError as exc:
        raise APIError(400, str(exc), param, "invalid_isq") from None


def requantizable(slot: ModelSlot) -> ServedModel:
    """The chat model a slot serves, when it can be re-quantized."""
    if slot.kind != "chat":
        raise APIError(400, f"the model {slot.id!r} is an embedding model: it has no ISQ", "model")
    if slot.parent is not None:
        raise APIError(
            400,
            f"{slot.id!r} is a LoRA adapter on {slot.parent.id!r}: re-quantize "
            f"{slot.parent.id!r} (its adapters run on its weights)",
            "model",
        )
    model = slot.model
    if not isinstance(model, ServedModel):
        raise lifecycle_error(ConflictError(f"the model {slot.id!r} is {slot.status}"))
    return model


def card(slot: ModelSlot, model: ServedModel) -> dict[str, Any]:
    out = {"status": str(slot.status), "quantization": model.isq}
    if model.imatrix is not None:
        out["imatrix"] = f"sha256:{model.imatrix.digest()}"
    return out | {"weight_bytes": model.weight_bytes}
