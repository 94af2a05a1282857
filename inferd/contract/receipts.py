"""Receipts: canonical-JSON records that bind a launch, a request and a stream together.

Each receipt's digest is the sha256 of its canonical JSON, so changing any bound field
changes the digest. Receipts are written once, read-only, under their own digest, and
reading one back re-checks that digest.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypedDict

from inferd.contract.canonical import INTEGRATION_RELEASE, canonical_json, sha256_hex
from inferd.contract.plan import LaunchPlan
from inferd.contract.request import ChatRequest
from inferd.contract.stream import (
    Cancelled,
    Finished,
    Outcome,
    ProtocolError,
    StreamConsumer,
    Usage,
    outcome_text,
)


class ReceiptError(ValueError):
    """A receipt file whose bytes do not match its name."""


@dataclass(frozen=True, kw_only=True)
class _Receipt:
    """What every receipt binds: the serving identity, the model route, the rules' release."""

    KIND: ClassVar[str] = ""

    serve_identity: str
    model_route: str
    release: str = INTEGRATION_RELEASE

    def canonical(self) -> bytes:
        return canonical_json({"kind": self.KIND, **asdict(self)})

    def to_dict(self) -> dict[str, Any]:
        """The receipt as plain JSON values (tuples become lists), exactly as digested."""
        value: dict[str, Any] = json.loads(self.canonical())
        return value

    @property
    def sha256(self) -> str:
        return sha256_hex(self.canonical())


@dataclass(frozen=True, kw_only=True)
class LaunchReceipt(_Receipt):
    KIND: ClassVar[str] = "launch"

    engine: str
    engine_version: str
    engine_artifact_sha256: str
    model_bundle_sha256: str
    model_revision: str
    argv: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class _RequestBound(_Receipt):
    """A receipt about one request: which one, by its id and the digest of its body."""

    request_id: str
    request_sha256: str


class _RequestBinding(TypedDict):
    """The fields of _RequestBound, as request_receipt and stream_receipt both fill them."""

    request_id: str
    request_sha256: str
    serve_identity: str
    model_route: str


@dataclass(frozen=True, kw_only=True)
class RequestReceipt(_RequestBound):
    KIND: ClassVar[str] = "request"

    endpoint: str
    request_bytes: int
    artifact_digests: tuple[str, ...]
    locator_digests: tuple[str, ...]
    max_tokens: int


@dataclass(frozen=True, kw_only=True)
class StreamReceipt(_RequestBound):
    KIND: ClassVar[str] = "stream"

    wire_sha256: str
    wire_bytes: int
    events: int
    keepalives: int
    outcome: str
    rule: str | None
    finish_reason: str | None
    response_id: str | None
    text_sha256: str
    text_bytes: int
    usage: Usage | None = field(default=None)


def launch_receipt(plan: LaunchPlan) -> LaunchReceipt:
    return LaunchReceipt(
        serve_identity=plan.identity_sha256(),
        engine=str(plan.engine.kind),
        engine_version=plan.engine.version,
        engine_artifact_sha256=plan.engine.artifact_sha256,
        model_bundle_sha256=plan.model.bundle_sha256,
        model_revision=plan.model.revision,
        model_route=plan.model_route,
        argv=plan.launch_args(),
    )


def _binding(plan: LaunchPlan, request: ChatRequest) -> _RequestBinding:
    return _RequestBinding(
        request_id=request.request_id,
        request_sha256=request.sha256,
        serve_identity=plan.identity_sha256(),
        model_route=request.model_route,
    )


def request_receipt(plan: LaunchPlan, request: ChatRequest) -> RequestReceipt:
    return RequestReceipt(
        **_binding(plan, request),
        endpoint=request.endpoint,
        request_bytes=len(request.body),
        artifact_digests=request.artifact_digests,
        locator_digests=request.locator_digests,
        max_tokens=request.max_tokens,
    )


def stream_receipt(
    plan: LaunchPlan, request: ChatRequest, consumer: StreamConsumer, outcome: Outcome
) -> StreamReceipt:
    encoded = outcome_text(outcome).encode("utf-8")
    return StreamReceipt(
        **_binding(plan, request),
        wire_sha256=consumer.wire_sha256,
        wire_bytes=consumer.wire_bytes,
        events=consumer.events,
        keepalives=consumer.keepalives,
        outcome=str(outcome.kind),
        rule=str(outcome.rule) if isinstance(outcome, ProtocolError) else None,
        finish_reason=outcome.finish_reason,
        response_id=outcome.response_id if isinstance(outcome, Finished) else None,
        text_sha256=sha256_hex(encoded),
        text_bytes=len(encoded),
        usage=outcome.usage if isinstance(outcome, Finished | Cancelled) else None,
    )


def write_receipt(directory: Path, receipt: _Receipt) -> Path:
    """Write ``receipt`` once as ``<kind>-<sha256>.json``, read-only; rewriting is a no-op."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{receipt.KIND}-{receipt.sha256}.json"
    if path.exists():
        read_receipt(path)
        return path
    tmp = directory / f".{path.name}.{os.getpid()}.tmp"
    tmp.write_bytes(receipt.canonical())
    tmp.chmod(0o444)
    os.replace(tmp, path)
    return path


def read_receipt(path: Path) -> dict[str, Any]:
    """The receipt at ``path`` after checking its bytes against the digest in its name."""
    data = path.read_bytes()
    digest = path.stem.rpartition("-")[2]
    if sha256_hex(data) != digest:
        raise ReceiptError(f"{path.name}: the bytes do not match the digest in the name")
    value = json.loads(data)
    if not isinstance(value, dict) or canonical_json(value) != data:
        raise ReceiptError(f"{path.name}: not a canonical JSON object")
    return value
