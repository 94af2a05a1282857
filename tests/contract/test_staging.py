"""Evidence staging: sniffing, bounds, write-once digest paths, escapes, tenants, cleanup."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from inferd.contract.canonical import sha256_hex
from inferd.contract.fixtures import tiny_mp4, tiny_png, tiny_wav
from inferd.contract.staging import (
    Artifact,
    CrossTenantError,
    EvidenceStore,
    MediaType,
    StagingError,
    sniff,
)

SAMPLES = {
    MediaType.PNG: tiny_png(),
    MediaType.JPEG: b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + bytes(32),
    MediaType.WEBP: b"RIFF\x24\x00\x00\x00WEBPVP8 " + bytes(32),
    MediaType.GIF: b"GIF89a\x01\x00\x01\x00" + bytes(32),
    MediaType.WAV: tiny_wav(),
    MediaType.MP3: b"ID3\x04\x00\x00\x00\x00\x00\x00" + bytes(32),
    MediaType.FLAC: b"fLaC\x00\x00\x00\x22" + bytes(32),
    MediaType.OGG: b"OggS\x00\x02" + bytes(32),
    MediaType.MP4: tiny_mp4(),
    MediaType.WEBM: b"\x1a\x45\xdf\xa3\x9f\x42\x86\x81\x01\x42\x82\x84webm" + bytes(16),
}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> EvidenceStore:
    return EvidenceStore(
        tmp_path / "evidence",
        published_root="/srv/evidence",
        max_bytes=4096,
        retention_s=60,
        clock=clock,
    )


@pytest.mark.parametrize("media", list(MediaType), ids=lambda m: m.ext)
def test_sniffing_recognizes_each_format(media: MediaType) -> None:
    assert sniff(SAMPLES[media]) is media


@pytest.mark.parametrize("data", [b"", b"hello world", b"%PDF-1.7", b"<svg xmlns=", b"PK\x03\x04"])
def test_unknown_bytes_are_refused(store: EvidenceStore, data: bytes) -> None:
    assert sniff(data) is None
    with pytest.raises(StagingError, match="supported"):
        store.stage("t1", "e1", data, locator="x")


def test_stage_writes_once_read_only_under_the_digest(store: EvidenceStore) -> None:
    data = SAMPLES[MediaType.PNG]
    ev = store.stage("t1", "e1", data, locator="s3://bucket/raw/IMG_0001.png")
    digest = sha256_hex(data)
    path = store.root / f"{digest}.png"
    assert ev.artifact == Artifact(digest, MediaType.PNG, len(data))
    assert path.read_bytes() == data
    assert stat.S_IMODE(path.stat().st_mode) == 0o444
    assert ev.locator_sha256 == sha256_hex(b"s3://bucket/raw/IMG_0001.png")
    lease = store.lease("t1", "r1", "e1")
    assert lease.url == f"file:///srv/evidence/{digest}.png"
    # staging the same bytes again is idempotent, and leaves nothing else behind
    store.stage("t1", "e2", data, locator="other")
    assert sorted(p.name for p in store.root.iterdir()) == [f"{digest}.png"]


def test_url_never_comes_from_the_callers_path_or_locator(store: EvidenceStore) -> None:
    ev = store.stage("t1", "e1", SAMPLES[MediaType.WAV], locator="../../../etc/passwd")
    url = store.lease("t1", "r1", "e1").url
    assert url == f"file:///srv/evidence/{ev.artifact.sha256}.wav"
    assert "passwd" not in url and ".." not in url


@pytest.mark.parametrize("digest", ["../../etc/passwd", "A" * 64, "a" * 63, "/" + "a" * 63])
def test_forged_digests_cannot_address_files(store: EvidenceStore, digest: str) -> None:
    forged = Artifact(digest, MediaType.PNG, 1)
    with pytest.raises(StagingError, match="digest"):
        store.url_for(forged)
    with pytest.raises(StagingError, match="digest"):
        store.path_for(forged)


@pytest.mark.parametrize("ident", ["", "a/b", "../x", "a b", "x" * 129, "é"])
def test_identifiers_are_tokens(store: EvidenceStore, ident: str) -> None:
    with pytest.raises(StagingError):
        store.stage(ident, "e1", SAMPLES[MediaType.PNG], locator="x")
    with pytest.raises(StagingError):
        store.stage("t1", ident, SAMPLES[MediaType.PNG], locator="x")


def test_planted_symlink_at_the_digest_path_is_refused(
    store: EvidenceStore, tmp_path: Path
) -> None:
    data = SAMPLES[MediaType.PNG]
    secret = tmp_path / "secret"
    secret.write_bytes(data)
    os.symlink(secret, store.root / f"{sha256_hex(data)}.png")
    with pytest.raises(StagingError, match="regular file"):
        store.stage("t1", "e1", data, locator="x")


def test_tampered_existing_file_is_refused(store: EvidenceStore) -> None:
    data = SAMPLES[MediaType.PNG]
    (store.root / f"{sha256_hex(data)}.png").write_bytes(b"\x89PNG\r\n\x1a\nother")
    with pytest.raises(StagingError, match="other bytes"):
        store.stage("t1", "e1", data, locator="x")


def test_size_bound_and_declared_type(store: EvidenceStore) -> None:
    with pytest.raises(StagingError, match="bound"):
        store.stage("t1", "e1", SAMPLES[MediaType.PNG] + bytes(5000), locator="x")
    with pytest.raises(StagingError, match="declared"):
        store.stage("t1", "e1", SAMPLES[MediaType.PNG], locator="x", expect=MediaType.JPEG)


def test_evidence_ids_are_immutable(store: EvidenceStore) -> None:
    store.stage("t1", "e1", SAMPLES[MediaType.PNG], locator="x")
    with pytest.raises(StagingError, match="already staged"):
        store.stage("t1", "e1", SAMPLES[MediaType.WAV], locator="x")


def test_a_tenant_cannot_reach_another_tenants_evidence(store: EvidenceStore) -> None:
    ev = store.stage("alice", "e1", SAMPLES[MediaType.PNG], locator="x")
    with pytest.raises(CrossTenantError):
        store.lease("mallory", "r1", "e1")
    with pytest.raises(CrossTenantError):
        store.authorize("mallory", ev.artifact.sha256)
    assert store.authorize("alice", ev.artifact.sha256) == ev.artifact


def test_cleanup_removes_only_expired_unreferenced_entries(
    store: EvidenceStore, clock: Clock
) -> None:
    held = store.stage("t1", "held", SAMPLES[MediaType.PNG], locator="x")
    idle = store.stage("t1", "idle", SAMPLES[MediaType.WAV], locator="y")
    lease_a = store.lease("t1", "r1", "held")
    lease_b = store.lease("t1", "r2", "held")
    assert store.references(held.artifact.sha256) == 2
    assert store.cleanup() == ()  # nothing has expired yet
    clock.now += 61
    assert store.cleanup() == (idle.artifact.sha256,)
    assert not store.path_for(idle.artifact).exists()
    store.release(lease_a)
    assert store.cleanup() == ()  # still referenced by r2
    assert store.path_for(held.artifact).exists()
    store.release(lease_b)
    store.release(lease_b)  # releasing twice is harmless
    assert store.references(held.artifact.sha256) == 0
    assert store.cleanup() == (held.artifact.sha256,)
    with pytest.raises(CrossTenantError):
        store.lease("t1", "r3", "held")


def test_published_root_must_be_url_safe(tmp_path: Path) -> None:
    for bad in ("relative", "/srv/with space", "/srv/../etc", "/", "/srv/%2e"):
        with pytest.raises(StagingError, match="published root"):
            EvidenceStore(tmp_path / "e", published_root=bad)
