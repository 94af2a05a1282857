"""Digest-addressed evidence staging: sniffed, bounded, write-once media for the server.

The inference process receives only ``file://<published root>/<sha256>.<ext>`` URLs built
from a digest and a sniffed format, never a caller's path or URL: that keeps server-side
file reads and remote fetches out of the caller's hands. Staged evidence belongs to the
tenant that staged it; requests reach it only through per-request leases, and cleanup only
removes entries that are both past retention and referenced by no lease.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from pathlib import Path, PurePosixPath

from inferd.contract.canonical import is_sha256, is_token, sha256_hex

# Names a file URL can carry without percent-encoding, so the URL is the path verbatim.
_URL_SAFE_PATH = re.compile(r"^(?:/[A-Za-z0-9._-]+)+$")


class Modality(StrEnum):
    TEXT = "text"
    IMAGE = "image"
    AUDIO = "audio"
    VIDEO = "video"


class MediaType(Enum):
    PNG = ("image/png", "png", Modality.IMAGE)
    JPEG = ("image/jpeg", "jpg", Modality.IMAGE)
    WEBP = ("image/webp", "webp", Modality.IMAGE)
    GIF = ("image/gif", "gif", Modality.IMAGE)
    WAV = ("audio/wav", "wav", Modality.AUDIO)
    MP3 = ("audio/mpeg", "mp3", Modality.AUDIO)
    FLAC = ("audio/flac", "flac", Modality.AUDIO)
    OGG = ("audio/ogg", "ogg", Modality.AUDIO)
    MP4 = ("video/mp4", "mp4", Modality.VIDEO)
    WEBM = ("video/webm", "webm", Modality.VIDEO)

    @property
    def mime(self) -> str:
        return self.value[0]

    @property
    def ext(self) -> str:
        return self.value[1]

    @property
    def modality(self) -> Modality:
        return self.value[2]


class StagingError(ValueError):
    """Bytes or identifiers that cannot be staged, or a staged file that was tampered with."""


class CrossTenantError(PermissionError):
    """A tenant named evidence it did not stage."""


class EvidenceInUseError(RuntimeError):
    """An operation that would pull evidence out from under an active lease."""


def sniff(data: bytes) -> MediaType | None:
    """The container format from magic bytes; extensions and declared types are not trusted."""
    head = data[:64]
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return MediaType.PNG
    if head.startswith(b"\xff\xd8\xff"):
        return MediaType.JPEG
    if head.startswith((b"GIF87a", b"GIF89a")):
        return MediaType.GIF
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return MediaType.WEBP
    if head.startswith(b"RIFF") and head[8:12] == b"WAVE":
        return MediaType.WAV
    if head.startswith(b"fLaC"):
        return MediaType.FLAC
    if head.startswith(b"OggS"):
        return MediaType.OGG
    if head[4:8] == b"ftyp":
        return MediaType.MP4
    if head.startswith(b"\x1a\x45\xdf\xa3") and b"webm" in head:
        return MediaType.WEBM
    if head.startswith(b"ID3") or (len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0):
        return MediaType.MP3
    return None


@dataclass(frozen=True)
class Artifact:
    sha256: str
    media_type: MediaType
    size: int

    @property
    def filename(self) -> str:
        return f"{self.sha256}.{self.media_type.ext}"


@dataclass(frozen=True)
class Evidence:
    """One tenant's evidence item: the artifact bytes and where they came from."""

    tenant: str
    evidence_id: str
    artifact: Artifact
    locator_sha256: str  # digest of the source locator; the locator itself never travels


@dataclass(frozen=True)
class Lease:
    lease_id: str
    tenant: str
    request_id: str
    evidence: Evidence
    url: str


@dataclass
class _Entry:
    artifact: Artifact
    owners: set[str] = field(default_factory=set)
    leases: set[str] = field(default_factory=set)
    retain_until: float = 0.0


class EvidenceStore:
    """Stages evidence under ``root`` and publishes it to the server as ``published_root``.

    ``published_root`` is the same directory as the inference process sees it (for example a
    read-only mount at /srv/evidence); it defaults to ``root``.
    """

    def __init__(
        self,
        root: Path,
        *,
        published_root: str | None = None,
        max_bytes: int = 64 << 20,
        retention_s: float = 3600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        if root.is_symlink():
            raise StagingError(f"staging root {root} must not be a symbolic link")
        self.published_root = _check_published_root(published_root or str(root.resolve()))
        self.max_bytes = max_bytes
        self.retention_s = retention_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._evidence: dict[tuple[str, str], Evidence] = {}
        self._leases: dict[str, Lease] = {}

    # -- staging --------------------------------------------------------------------------
    def stage(
        self,
        tenant: str,
        evidence_id: str,
        data: bytes,
        *,
        locator: str,
        expect: MediaType | None = None,
    ) -> Evidence:
        """Sniff, bound, hash and publish ``data`` once; ``locator`` is only ever hashed."""
        _check_id("tenant", tenant)
        _check_id("evidence_id", evidence_id)
        if len(data) > self.max_bytes:
            raise StagingError(f"evidence is {len(data)} bytes, over the {self.max_bytes} bound")
        media = sniff(data)
        if media is None:
            raise StagingError("evidence bytes are not a supported image, audio or video format")
        if expect is not None and media is not expect:
            raise StagingError(f"evidence declared {expect.mime} but its bytes are {media.mime}")
        artifact = Artifact(sha256_hex(data), media, len(data))
        evidence = Evidence(tenant, evidence_id, artifact, sha256_hex(locator.encode("utf-8")))
        with self._lock:
            known = self._evidence.get((tenant, evidence_id))
            if known is not None and known != evidence:
                raise StagingError(f"evidence {evidence_id!r} was already staged with other bytes")
            self._write_once(artifact, data)
            entry = self._entries.setdefault(artifact.sha256, _Entry(artifact))
            entry.owners.add(tenant)
            entry.retain_until = max(entry.retain_until, self._clock() + self.retention_s)
            self._evidence[(tenant, evidence_id)] = evidence
        return evidence

    def _write_once(self, artifact: Artifact, data: bytes) -> None:
        path = self.root / artifact.filename
        if os.path.lexists(path):
            self._verify_existing(path, artifact)
            return
        fd, tmp = tempfile.mkstemp(prefix=".stage-", dir=self.root)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o444)
            # link() refuses to replace an existing name: a racing writer cannot be clobbered.
            os.link(tmp, path)
        except FileExistsError:
            self._verify_existing(path, artifact)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    @staticmethod
    def _verify_existing(path: Path, artifact: Artifact) -> None:
        if path.is_symlink() or not path.is_file():
            raise StagingError(f"{path.name} exists but is not a regular file")
        if sha256_hex(path.read_bytes()) != artifact.sha256:
            raise StagingError(f"{path.name} exists with other bytes")

    # -- addressing -----------------------------------------------------------------------
    def url_for(self, artifact: Artifact) -> str:
        """The server-side URL, built from the digest and the sniffed format alone."""
        if not is_sha256(artifact.sha256):
            raise StagingError(f"{artifact.sha256!r} is not a sha256 digest")
        return f"file://{self.published_root}/{artifact.filename}"

    def path_for(self, artifact: Artifact) -> Path:
        if not is_sha256(artifact.sha256):
            raise StagingError(f"{artifact.sha256!r} is not a sha256 digest")
        return self.root / artifact.filename

    # -- leases ---------------------------------------------------------------------------
    def lease(self, tenant: str, request_id: str, evidence_id: str) -> Lease:
        """Reference one of ``tenant``'s own evidence items from one request."""
        _check_id("tenant", tenant)
        _check_id("request_id", request_id)
        with self._lock:
            evidence = self._evidence.get((tenant, evidence_id))
            if evidence is None:
                raise CrossTenantError(f"tenant {tenant!r} has no evidence {evidence_id!r}")
            entry = self._entries[evidence.artifact.sha256]
            lease = Lease(
                uuid.uuid4().hex, tenant, request_id, evidence, self.url_for(entry.artifact)
            )
            entry.leases.add(lease.lease_id)
            self._leases[lease.lease_id] = lease
        return lease

    def authorize(self, tenant: str, sha256: str) -> Artifact:
        """The artifact ``sha256`` if ``tenant`` staged it; for callers holding a bare digest."""
        with self._lock:
            entry = self._entries.get(sha256)
            if entry is None or tenant not in entry.owners:
                raise CrossTenantError(f"tenant {tenant!r} has not staged {sha256}")
            return entry.artifact

    def is_active(self, lease: Lease) -> bool:
        with self._lock:
            return self._leases.get(lease.lease_id) == lease

    def release(self, lease: Lease) -> None:
        with self._lock:
            if self._leases.pop(lease.lease_id, None) is None:
                return
            entry = self._entries.get(lease.evidence.artifact.sha256)
            if entry is not None:
                entry.leases.discard(lease.lease_id)

    def references(self, sha256: str) -> int:
        with self._lock:
            entry = self._entries.get(sha256)
            return 0 if entry is None else len(entry.leases)

    # -- cleanup --------------------------------------------------------------------------
    def cleanup(self) -> tuple[str, ...]:
        """Remove entries past retention with no lease; returns the removed digests."""
        now = self._clock()
        removed = []
        with self._lock:
            for sha, entry in list(self._entries.items()):
                if entry.leases or entry.retain_until > now:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.root / entry.artifact.filename)
                del self._entries[sha]
                removed.append(sha)
            gone = set(removed)
            self._evidence = {
                k: v for k, v in self._evidence.items() if v.artifact.sha256 not in gone
            }
        return tuple(sorted(removed))


def _check_id(name: str, value: str) -> None:
    if not is_token(value):
        raise StagingError(f"{name} must be 1-128 characters of [A-Za-z0-9._:-], got {value!r}")


def _check_published_root(value: str) -> str:
    path = PurePosixPath(value)
    if not path.is_absolute() or path.as_posix() != value or ".." in path.parts:
        raise StagingError(f"published root {value!r} must be an absolute, normalized path")
    if value == "/" or not _URL_SAFE_PATH.fullmatch(value):
        raise StagingError(f"published root {value!r} must be a directory with URL-safe names")
    return value
