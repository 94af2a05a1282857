"""The bounded request builder: part order, independent bounds, tenancy, receipts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from inferd.contract.example import EXAMPLE_BOUNDS, example_plan
from inferd.contract.fixtures import tiny_mp4, tiny_png, tiny_wav
from inferd.contract.request import (
    ChatRequest,
    JsonTooLarge,
    MediaPart,
    MediaTooLarge,
    ModalityNotAdmitted,
    OutputTokensTooLarge,
    Part,
    PromptTooLarge,
    RequestBoundError,
    RequestBounds,
    RequestError,
    TextPart,
    TooManyMediaParts,
    build_chat_request,
)
from inferd.contract.staging import EvidenceStore, Lease, Modality

RID = "req-1"


@pytest.fixture
def store(tmp_path: Path) -> EvidenceStore:
    s = EvidenceStore(tmp_path / "ev", published_root="/srv/evidence")
    s.stage("t1", "png", tiny_png(), locator="loc-png")
    s.stage("t1", "png2", tiny_png(6, 6), locator="loc-png2")
    s.stage("t1", "wav", tiny_wav(), locator="loc-wav")
    s.stage("t1", "mp4", tiny_mp4(), locator="loc-mp4")
    s.stage("t2", "theirs", tiny_png(5, 5), locator="loc-theirs")
    return s


def _lease(store: EvidenceStore, evidence_id: str, tenant: str = "t1", rid: str = RID) -> Lease:
    return store.lease(tenant, rid, evidence_id)


def _build(store: EvidenceStore | None, parts: tuple[Part, ...], **kw: object) -> ChatRequest:
    args: dict[str, object] = {
        "request_id": RID, "tenant": "t1", "parts": parts, "max_tokens": 64,
        "temperature": 0.0, "seed": 7, "bounds": EXAMPLE_BOUNDS, "store": store,
    }  # fmt: skip
    args.update(kw)
    return build_chat_request(example_plan(), **args)  # type: ignore[arg-type]


def _wire_types(body: bytes) -> list[str]:
    return [p["type"] for p in json.loads(body)["messages"][0]["content"]]


def test_body_is_explicit_and_canonical(store: EvidenceStore) -> None:
    req = _build(store, (TextPart("hi"),))
    body = json.loads(req.body)
    assert body == {
        "model": example_plan().model_route,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_tokens": 64, "temperature": 0.0, "seed": 7, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    assert req.body == json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    assert req.headers()["x-request-id"] == RID


@pytest.mark.parametrize(
    "order",
    [
        ("png", "wav", "mp4", "text"),
        ("text", "mp4", "wav", "png"),
        ("png2", "png", "text"),
        ("png", "png2", "text"),
    ],
)
def test_part_order_survives_serialization(store: EvidenceStore, order: tuple[str, ...]) -> None:
    leases = {e: _lease(store, e) for e in order if e != "text"}
    parts = tuple(TextPart("What changed?") if e == "text" else MediaPart(leases[e]) for e in order)
    req = _build(store, parts)
    kinds = {
        "png": "image_url",
        "png2": "image_url",
        "wav": "audio_url",
        "mp4": "video_url",
        "text": "text",
    }
    assert _wire_types(req.body) == [kinds[e] for e in order]
    media = [leases[e] for e in order if e != "text"]
    assert req.artifact_digests == tuple(m.evidence.artifact.sha256 for m in media)
    assert req.locator_digests == tuple(m.evidence.locator_sha256 for m in media)
    content = json.loads(req.body)["messages"][0]["content"]
    urls = [p[p["type"]]["url"] for p in content if p["type"] != "text"]
    assert urls == [m.url for m in media]


def test_swapping_two_images_changes_the_request(store: EvidenceStore) -> None:
    a, b = _lease(store, "png"), _lease(store, "png2")
    first = _build(store, (MediaPart(a), MediaPart(b), TextPart("What changed?")))
    second = _build(store, (MediaPart(b), MediaPart(a), TextPart("What changed?")))
    assert first.sha256 != second.sha256
    assert first.artifact_digests == tuple(reversed(second.artifact_digests))


# Each case breaks exactly one bound; the base request passes all of them.
BASE = RequestBounds(
    max_prompt_bytes=100,
    max_media_parts=3,
    max_media_bytes=2000,
    max_output_tokens=64,
    max_json_bytes=2000,
    modalities=frozenset(Modality),
)


def _three_parts(store: EvidenceStore) -> tuple[Part, ...]:
    return (MediaPart(_lease(store, "png")), MediaPart(_lease(store, "wav")), TextPart("Describe."))


@pytest.mark.parametrize(
    ("error", "change"),
    [
        (PromptTooLarge, {"max_prompt_bytes": 8}),
        (TooManyMediaParts, {"max_media_parts": 1}),
        (MediaTooLarge, {"max_media_bytes": 900}),
        (OutputTokensTooLarge, {"max_output_tokens": 63}),
        (JsonTooLarge, {"max_json_bytes": 300}),
        (ModalityNotAdmitted, {"modalities": frozenset({Modality.TEXT, Modality.IMAGE})}),
    ],
)
def test_each_bound_fails_independently(
    store: EvidenceStore, error: type[RequestBoundError], change: dict[str, object]
) -> None:
    parts = _three_parts(store)
    assert _build(store, parts, bounds=BASE).max_tokens == 64
    with pytest.raises(error) as info:
        _build(store, parts, bounds=dataclasses.replace(BASE, **change))  # type: ignore[arg-type]
    assert type(info.value) is error
    assert info.value.bound == next(iter(change))


def test_small_files_can_pass_the_count_and_fail_the_bytes(store: EvidenceStore) -> None:
    parts = (MediaPart(_lease(store, "wav")), TextPart("x"))
    bounds = dataclasses.replace(BASE, max_media_parts=8, max_media_bytes=100)
    with pytest.raises(MediaTooLarge):
        _build(store, parts, bounds=bounds)


def test_multibyte_prompt_is_counted_in_bytes(store: EvidenceStore) -> None:
    text = "é" * 30  # 30 characters, 60 bytes
    _build(store, (TextPart(text),), bounds=dataclasses.replace(BASE, max_prompt_bytes=60))
    with pytest.raises(PromptTooLarge):
        _build(store, (TextPart(text),), bounds=dataclasses.replace(BASE, max_prompt_bytes=59))


def test_text_only_bounds_refuse_media(store: EvidenceStore) -> None:
    text_only = dataclasses.replace(BASE, modalities=frozenset({Modality.TEXT}))
    with pytest.raises(ModalityNotAdmitted, match="image"):
        _build(store, _three_parts(store), bounds=text_only)


def test_another_tenants_lease_cannot_be_used(store: EvidenceStore) -> None:
    theirs = store.lease("t2", RID, "theirs")
    with pytest.raises(RequestError, match="another tenant"):
        _build(store, (MediaPart(theirs), TextPart("x")))


def test_a_lease_for_another_request_cannot_be_used(store: EvidenceStore) -> None:
    other = _lease(store, "png", rid="req-2")
    with pytest.raises(RequestError, match="another request"):
        _build(store, (MediaPart(other), TextPart("x")))


def test_a_released_lease_cannot_be_used(store: EvidenceStore) -> None:
    lease = _lease(store, "png")
    store.release(lease)
    with pytest.raises(RequestError, match="released"):
        _build(store, (MediaPart(lease), TextPart("x")))
    with pytest.raises(RequestError, match="evidence store"):
        _build(None, (MediaPart(_lease(store, "png")), TextPart("x")))


@pytest.mark.parametrize(
    "change",
    [
        {"request_id": "has space"}, {"request_id": ""}, {"request_id": "x" * 129},
        {"parts": ()}, {"parts": (TextPart(""),)}, {"parts": (TextPart("a\x00b"),)},
        {"max_tokens": 0}, {"max_tokens": True}, {"temperature": float("nan")},
        {"temperature": 2.5}, {"seed": -1}, {"seed": 2**63},
    ],
)  # fmt: skip
def test_malformed_requests_are_refused(store: EvidenceStore, change: dict[str, object]) -> None:
    args: dict[str, object] = {"parts": (TextPart("hi"),)}
    args.update(change)
    with pytest.raises(RequestError) as info:
        _build(store, **args)  # type: ignore[arg-type]
    assert not isinstance(info.value, RequestBoundError)
