"""Bounded chat-completion requests with ordered content parts.

Parts keep the caller's order (image, audio, video and text interleaved as given): order is
meaning to a multimodal model, so nothing here sorts them, and canonical JSON only sorts
object keys. Each bound fails with its own error type, because the bounds are independent:
three small files can pass the count and fail the bytes, a tiny JSON body can point at a
huge staged video.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from inferd.contract.canonical import canonical_json, is_token, sha256_hex
from inferd.contract.plan import LaunchPlan
from inferd.contract.staging import EvidenceStore, Lease, Modality

CHAT_ENDPOINT = "/v1/chat/completions"
REQUEST_ID_HEADER = "x-request-id"


class RequestError(ValueError):
    """A request that is malformed regardless of bounds."""


class RequestBoundError(RequestError):
    """A request over one of its independent bounds; ``bound`` names it."""

    bound = ""


class PromptTooLarge(RequestBoundError):
    bound = "max_prompt_bytes"


class TooManyMediaParts(RequestBoundError):
    bound = "max_media_parts"


class MediaTooLarge(RequestBoundError):
    bound = "max_media_bytes"


class OutputTokensTooLarge(RequestBoundError):
    bound = "max_output_tokens"


class JsonTooLarge(RequestBoundError):
    bound = "max_json_bytes"


class ModalityNotAdmitted(RequestBoundError):
    bound = "modalities"


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class MediaPart:
    lease: Lease


Part = TextPart | MediaPart


@dataclass(frozen=True)
class RequestBounds:
    max_prompt_bytes: int
    max_media_parts: int
    max_media_bytes: int
    max_output_tokens: int
    max_json_bytes: int
    modalities: frozenset[Modality]


@dataclass(frozen=True)
class ChatRequest:
    """A built request: the exact body bytes plus what receipts and validators need."""

    request_id: str
    tenant: str
    model_route: str
    body: bytes
    max_tokens: int
    include_usage: bool
    artifact_digests: tuple[str, ...]  # in part order
    locator_digests: tuple[str, ...]  # in part order
    endpoint: str = CHAT_ENDPOINT

    @property
    def sha256(self) -> str:
        return sha256_hex(self.body)

    def headers(self) -> dict[str, str]:
        return {
            "content-type": "application/json",
            "accept": "text/event-stream",
            REQUEST_ID_HEADER: self.request_id,
        }


def build_chat_request(
    plan: LaunchPlan,
    *,
    request_id: str,
    tenant: str,
    parts: tuple[Part, ...],
    max_tokens: int,
    temperature: float,
    seed: int,
    bounds: RequestBounds,
    store: EvidenceStore | None = None,
    tools: tuple[dict[str, Any], ...] = (),
    tool_choice: str | dict[str, Any] | None = None,
) -> ChatRequest:
    """Validate ``parts`` against ``bounds`` and serialize one streaming chat request.

    Media parts need ``store``: a lease that was released (its artifact may be cleaned up
    at any moment) must not end up in a request.
    """
    _check_parts(request_id, tenant, parts, store)
    _check_sampling(max_tokens, temperature, seed)
    leases = [p.lease for p in parts if isinstance(p, MediaPart)]
    _check_bounds(parts, leases, max_tokens, bounds)
    wire: dict[str, Any] = {
        "model": plan.model_route,
        "messages": [{"role": "user", "content": [_wire_part(p) for p in parts]}],
        "max_tokens": max_tokens,
        "temperature": float(temperature),
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if tools:  # the stream's calls are then checked whole (tool_calls.py)
        wire["tools"] = list(tools)
    if tool_choice is not None:
        if not tools:
            raise RequestError("tool_choice needs tools")
        wire["tool_choice"] = tool_choice
    body = canonical_json(wire)
    _within(JsonTooLarge, bounds, len(body), "bytes of request JSON")
    return ChatRequest(
        request_id=request_id,
        tenant=tenant,
        model_route=plan.model_route,
        body=body,
        max_tokens=max_tokens,
        include_usage=True,
        artifact_digests=tuple(lease.evidence.artifact.sha256 for lease in leases),
        locator_digests=tuple(lease.evidence.locator_sha256 for lease in leases),
    )


def _check_parts(
    request_id: str, tenant: str, parts: tuple[Part, ...], store: EvidenceStore | None
) -> None:
    if not is_token(request_id):
        raise RequestError(
            f"request_id must be 1-128 characters of [A-Za-z0-9._:-]: {request_id!r}"
        )
    if not parts:
        raise RequestError("a request needs at least one content part")
    for index, part in enumerate(parts):
        if isinstance(part, TextPart):
            if not isinstance(part.text, str) or not part.text or "\x00" in part.text:
                raise RequestError(f"part {index}: text must be a non-empty, NUL-free string")
            continue
        lease = part.lease
        # A lease is scoped to one tenant and one request; anything else is somebody else's.
        if lease.tenant != tenant or lease.evidence.tenant != tenant:
            raise RequestError(f"part {index}: the evidence belongs to another tenant")
        if lease.request_id != request_id:
            raise RequestError(f"part {index}: the lease was taken for another request")
        if store is None:
            raise RequestError("media parts need the evidence store to confirm their leases")
        if not store.is_active(lease):
            raise RequestError(f"part {index}: the lease was released")


def _check_sampling(max_tokens: int, temperature: float, seed: int) -> None:
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise RequestError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if not isinstance(temperature, int | float) or not math.isfinite(temperature):
        raise RequestError(f"temperature must be a finite number, got {temperature!r}")
    if not 0.0 <= temperature <= 2.0:
        raise RequestError(f"temperature must be within [0, 2], got {temperature}")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise RequestError(f"seed must be an integer in [0, 2**63), got {seed!r}")


def _check_bounds(
    parts: tuple[Part, ...], leases: list[Lease], max_tokens: int, bounds: RequestBounds
) -> None:
    for index, part in enumerate(parts):
        modality = _modality(part)
        if modality not in bounds.modalities:
            raise ModalityNotAdmitted(f"part {index}: {modality} input is not admitted")
    _within(TooManyMediaParts, bounds, len(leases), "media parts")
    media_bytes = sum(lease.evidence.artifact.size for lease in leases)
    _within(MediaTooLarge, bounds, media_bytes, "bytes of media")
    prompt_bytes = sum(len(p.text.encode("utf-8")) for p in parts if isinstance(p, TextPart))
    _within(PromptTooLarge, bounds, prompt_bytes, "bytes of prompt text")
    _within(OutputTokensTooLarge, bounds, max_tokens, "max_tokens")


def _within(error: type[RequestBoundError], bounds: RequestBounds, value: int, what: str) -> None:
    """Raise ``error`` when ``value`` is over the bound the error type names."""
    limit = getattr(bounds, error.bound)
    if value > limit:
        raise error(f"{what}: {value}, over {error.bound} {limit}")


def _modality(part: Part) -> Modality:
    if isinstance(part, TextPart):
        return Modality.TEXT
    return part.lease.evidence.artifact.media_type.modality


_URL_PART = {Modality.IMAGE: "image_url", Modality.AUDIO: "audio_url", Modality.VIDEO: "video_url"}


def _wire_part(part: Part) -> dict[str, Any]:
    if isinstance(part, TextPart):
        return {"type": "text", "text": part.text}
    kind = _URL_PART[part.lease.evidence.artifact.media_type.modality]
    return {"type": kind, kind: {"url": part.lease.url}}
