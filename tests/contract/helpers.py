"""Shared builders for the contract tests."""

from __future__ import annotations

import itertools

from inferd.contract.plan import (
    AccessLog,
    Device,
    EngineKind,
    EngineRelease,
    LaunchPlan,
    Limits,
    ModelFormat,
    ModelSource,
    PagedAttention,
    Toggle,
)
from inferd.contract.stream import Expectation, Outcome, StreamConsumer, StreamLimits

BUNDLE = "4" * 64
ARTIFACT = "5" * 64


def inferd_plan(
    *,
    local_root: str = "/srv/models",
    bundle: str = BUNDLE,
    artifact: str = ARTIFACT,
    entry: str = "model.gguf",
    port: int = 8080,
    version: str = "0.1.0",
    revision: str = "sha256:" + "6" * 64,
    access_log: AccessLog = AccessLog.DEFAULT,
) -> LaunchPlan:
    """A pinned ``inferd serve`` plan for the default model: f32, 4 seqs, 2048 context."""
    return LaunchPlan(
        engine=EngineRelease(EngineKind.INFERD, version, artifact, Device.CPU),
        model=ModelSource(
            public_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            revision=revision,
            bundle_sha256=bundle,
            local_dir=f"{local_root}/{bundle}",
            format=ModelFormat.GGUF,
            entry=entry,
        ),
        host="127.0.0.1",
        port=port,
        limits=Limits(
            max_seqs=4,
            max_seq_len=2048,
            paged_attention=PagedAttention.ON,
            prefix_cache_n=None,
            max_num_images=0,
            max_image_edge=0,
            device=Device.CPU,
            max_num_batched_tokens=512,
            kv_cache_tokens=8192,
            dtype="f32",
            seed=7,
            prefix_caching=Toggle.ON,
        ),
        access_log=access_log,
    )


def consume(
    pieces: list[bytes],
    expect: Expectation,
    limits: StreamLimits | None = None,
) -> tuple[Outcome, str, int, int]:
    """Feed ``pieces`` in order, then end of bytes: (outcome, wire digest, events, keep-alives)."""
    consumer = StreamConsumer(expect, limits)
    for piece in pieces:
        consumer.feed(piece)
    outcome = consumer.finish()
    return outcome, consumer.wire_sha256, consumer.events, consumer.keepalives


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    edges = [0, *sorted(set(cuts)), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges)]
