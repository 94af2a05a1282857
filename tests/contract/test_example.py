"""The worked example: one deterministic JSON report for the seed's scenario."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from inferd.contract.example import PROMPT, build_report
from inferd.contract.fixtures import EXAMPLE_TEXT
from tests.contract.test_plan import MISTRALRS_ARGV


def test_module_prints_one_deterministic_json_report() -> None:
    runs = [
        subprocess.run(
            [sys.executable, "-m", "inferd.contract.example"], capture_output=True, check=True
        ).stdout
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    report = json.loads(runs[0])
    launch, request, stream = report["launch"], report["request"], report["stream"]
    assert " ".join(launch["argv"]) == MISTRALRS_ARGV
    assert launch["engine"] == "mistralrs 0.8.2"
    assert request["part_types"] == ["image_url", "audio_url", "video_url", "text"]
    assert [e["media_type"] for e in report["evidence"]] == ["image/png", "audio/wav", "video/mp4"]
    for item, ext in zip(report["evidence"], ("png", "wav", "mp4"), strict=True):
        assert item["url"] == f"file:///srv/mosaic-evidence/{item['sha256']}.{ext}"
    body = request["body"]
    assert body["messages"][0]["content"][3] == {"type": "text", "text": PROMPT}
    assert (body["max_tokens"], body["temperature"], body["seed"]) == (64, 0.0, 7)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert request["bytes"] == 735
    assert stream["outcome"] == "complete" and stream["success"] is True
    assert stream["text"] == EXAMPLE_TEXT
    assert stream["usage"] == {"prompt_tokens": 128, "completion_tokens": 9, "total_tokens": 137}


def test_receipts_bind_the_same_identities(tmp_path: Path) -> None:
    report = build_report(tmp_path)
    receipts = report["receipts"]
    identity = report["launch"]["identity_sha256"]
    assert {r["serve_identity"] for r in receipts.values()} == {identity}
    assert receipts["request"]["request_sha256"] == report["request"]["sha256"]
    assert receipts["stream"]["request_sha256"] == report["request"]["sha256"]
    assert receipts["stream"]["wire_sha256"] == report["stream"]["wire_sha256"]
    assert receipts["request"]["artifact_digests"] == [e["sha256"] for e in report["evidence"]]
    assert receipts["request"]["locator_digests"] == [
        e["locator_sha256"] for e in report["evidence"]
    ]
