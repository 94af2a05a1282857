"""The worked example: ``python -m inferd.contract.example`` prints one JSON report.

It pins a conservative mistral.rs launch (loopback, no UI, JSON access logs, 4 sequences,
8192 context, batch 4, paged attention off, prefix cache 4, 4 images of edge 1024, CPU),
stages a PNG, a WAV and an MP4, builds a request with those parts and the text in that
order, and validates a realistic SSE fixture into a Complete outcome with usage
128 + 9 = 137. It proves the integration protocol, not that any model wrote the sentence:
the digests of the binary and the bundle are placeholders, and no process is started.

``--live`` runs the scenario for real instead (``contract/live.py``): ``inferd serve`` on tiny
random models in one config, the PNG, WAV and MP4 with the text to one model (Gemma 4), then
by modality to two (SmolVLM2, Qwen2-Audio), each a strict stream to Complete. ``--build-tiny DIR``
builds the checkpoints there first (from a source checkout, transformers needed; the default
is a temporary folder); ``--checkpoints DIR`` uses ones already built.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from inferd.contract.canonical import INTEGRATION_RELEASE
from inferd.contract.fixtures import EXAMPLE_BUNDLE, EXAMPLE_SSE, tiny_mp4, tiny_png, tiny_wav
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
)
from inferd.contract.receipts import launch_receipt, request_receipt, stream_receipt
from inferd.contract.request import MediaPart, Part, RequestBounds, TextPart, build_chat_request
from inferd.contract.staging import EvidenceStore, Modality
from inferd.contract.stream import (
    Expectation,
    Finished,
    Outcome,
    StreamConsumer,
    outcome_text,
)

PLACEHOLDER_BINARY_SHA256 = "1" * 64
PLACEHOLDER_REVISION = "3" * 40
TENANT = "tenant-a"
REQUEST_ID = "req-example-0001"
PROMPT = "Explain the same cancellation event across all evidence."


def example_plan() -> LaunchPlan:
    return LaunchPlan(
        engine=EngineRelease(EngineKind.MISTRALRS, "0.8.2", PLACEHOLDER_BINARY_SHA256, Device.CPU),
        model=ModelSource(
            public_id="google/gemma-4-e4b-it",
            revision=PLACEHOLDER_REVISION,
            bundle_sha256=EXAMPLE_BUNDLE,
            local_dir=f"/srv/mosaic-models/{EXAMPLE_BUNDLE}",
            format=ModelFormat.PLAIN,
        ),
        host="127.0.0.1",
        port=1234,
        limits=Limits(
            max_seqs=4,
            max_seq_len=8192,
            max_batch_size=4,
            paged_attention=PagedAttention.OFF,
            prefix_cache_n=4,
            max_num_images=4,
            max_image_edge=1024,
            device=Device.CPU,
        ),
        access_log=AccessLog.JSON,
    )


EXAMPLE_BOUNDS = RequestBounds(
    max_prompt_bytes=4096,
    max_media_parts=4,
    max_media_bytes=1 << 20,
    max_output_tokens=256,
    max_json_bytes=4096,
    modalities=frozenset(Modality),
)


def build_report(staging_root: Path) -> dict[str, Any]:
    plan = example_plan()
    store = EvidenceStore(staging_root, published_root="/srv/mosaic-evidence")
    sources = [
        ("ev-image", tiny_png(), "evidence://case-17/camera-2/frame-0412.png"),
        ("ev-audio", tiny_wav(), "evidence://case-17/radio/clip-0007.wav"),
        ("ev-video", tiny_mp4(), "evidence://case-17/camera-2/segment-0003.mp4"),
    ]
    leases = []
    for evidence_id, data, locator in sources:
        store.stage(TENANT, evidence_id, data, locator=locator)
        leases.append(store.lease(TENANT, REQUEST_ID, evidence_id))
    parts: tuple[Part, ...] = (*(MediaPart(lease) for lease in leases), TextPart(PROMPT))
    request = build_chat_request(
        plan,
        request_id=REQUEST_ID,
        tenant=TENANT,
        parts=parts,
        max_tokens=64,
        temperature=0.0,
        seed=7,
        bounds=EXAMPLE_BOUNDS,
        store=store,
    )
    consumer = StreamConsumer(Expectation(plan.model_route, request.max_tokens, True))
    consumer.feed(EXAMPLE_SSE)
    outcome = consumer.finish()
    for lease in leases:
        store.release(lease)
    receipts = {
        "launch": launch_receipt(plan),
        "request": request_receipt(plan, request),
        "stream": stream_receipt(plan, request, consumer, outcome),
    }
    body = json.loads(request.body)
    return {
        "release": INTEGRATION_RELEASE,
        "launch": {
            "engine": f"{plan.engine.kind} {plan.engine.version}",
            "identity_sha256": plan.identity_sha256(),
            "argv": list(plan.launch_args()),
            "model_route": plan.model_route,
        },
        "evidence": [
            {
                "media_type": lease.evidence.artifact.media_type.mime,
                "bytes": lease.evidence.artifact.size,
                "sha256": lease.evidence.artifact.sha256,
                "locator_sha256": lease.evidence.locator_sha256,
                "url": lease.url,
            }
            for lease in leases
        ],
        "request": {
            "request_id": request.request_id,
            "bytes": len(request.body),
            "sha256": request.sha256,
            "part_types": [p["type"] for p in body["messages"][0]["content"]],
            "body": body,
        },
        "stream": {
            "outcome": str(outcome.kind),
            "success": outcome.ok,
            "text": outcome_text(outcome),
            "usage": _usage(outcome),
            "wire_bytes": consumer.wire_bytes,
            "wire_sha256": consumer.wire_sha256,
            "events": consumer.events,
            "keepalives": consumer.keepalives,
        },
        "receipts": {name: {**r.to_dict(), "sha256": r.sha256} for name, r in receipts.items()},
    }


def _usage(outcome: Outcome) -> dict[str, int] | None:
    if isinstance(outcome, Finished) and outcome.usage is not None:
        return asdict(outcome.usage)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inferd.contract.example")
    parser.add_argument("--live", action="store_true", help="run the scenario on inferd serve")
    parser.add_argument("--build-tiny", type=Path, metavar="DIR", help="build checkpoints here")
    parser.add_argument("--checkpoints", type=Path, metavar="DIR", help="use checkpoints here")
    args = parser.parse_args(argv)
    if args.live:
        from inferd.contract.live import main as live_main

        return live_main(args.build_tiny, args.checkpoints)
    if args.build_tiny or args.checkpoints:
        parser.error("--build-tiny and --checkpoints go with --live")
    with tempfile.TemporaryDirectory(prefix="inferd-contract-example-") as tmp:
        report = build_report(Path(tmp))
    json.dump(report, sys.stdout, indent=2, sort_keys=True, ensure_ascii=False)
    sys.stdout.write("\n")
    return 0 if report["stream"]["success"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
