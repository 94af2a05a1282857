"""``inferd gate`` on a multimodal release: a tiny random Gemma 4 (images, audio, video) served
by ``inferd serve --config`` from a bundle. The gate's own case file (examples/gate/cases.json:
text, structured output, a tool call, adversarial input, an image, an audio clip, a video and
the seed's worked example: the PNG, the WAV and the MP4 with the text in one request) is frozen
with each request's media digests; the unchanged release passes ``check``, and a release whose
image preprocessing differs (its processor's soft-token budget) fails, naming the cases that
carry an image and no others."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

import inferd
from inferd.bench.process import free_port
from inferd.cli import main
from inferd.contract.bundle import artifact_sha256, publish_bundle, tree_files
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
    plan_to_dict,
)
from inferd.contract.supervisor import Executable

ROUTE = "gemma4"
CASES = Path("examples/gate/cases.json")
WITH_AN_IMAGE = {"image", "worked-example"}


def _plan(root: Path, checkpoint: Path, name: str) -> Path:
    """A pinned plan serving ``checkpoint`` as the one model of a config bundle."""
    scratch = root / f"{name}-config"
    scratch.mkdir()
    (scratch / "models.json").write_text(
        json.dumps({ROUTE: {"Plain": {"model_id": f"./{ROUTE}"}, "alias": ROUTE}})
    )
    files = tree_files(checkpoint, f"{ROUTE}/") | {"models.json": scratch / "models.json"}
    bundle = publish_bundle(files, root / "bundles")
    plan = LaunchPlan(
        engine=EngineRelease(
            EngineKind.INFERD,
            inferd.__version__,
            artifact_sha256(Executable.inferd_module().artifact),
            Device.CPU,
        ),
        model=ModelSource(
            public_id="inferd/tiny-gemma4",
            revision="sha256:" + bundle.name,
            bundle_sha256=bundle.name,
            local_dir=str(bundle),
            format=ModelFormat.CONFIG,
            entry="models.json",
            route=ROUTE,
        ),
        host="127.0.0.1",
        port=free_port(),
        limits=Limits(
            max_seqs=2,
            max_seq_len=512,  # the tiny checkpoint's positions
            paged_attention=PagedAttention.ON,
            prefix_cache_n=None,
            max_num_images=4,
            max_image_edge=0,
            device=Device.CPU,
            max_num_batched_tokens=512,
            kv_cache_tokens=4096,
            dtype="f32",
            seed=0,
            prefix_caching=Toggle.ON,
        ),
        access_log=AccessLog.JSON,
    )
    path = root / f"{name}.json"
    path.write_text(json.dumps(plan_to_dict(plan)))
    return path


def _rows(report: dict[str, Any], kind: str) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in report["rows"] if r["kind"] == kind}


def _check(root: Path, plan: Path, golden: Path, name: str) -> tuple[int, dict[str, Any]]:
    report = root / f"{name}-report.json"
    code = main(["gate", "check", str(plan), str(golden), "--report", str(report)])
    return code, json.loads(report.read_text())


def _media_digests(body: dict[str, Any]) -> list[str]:
    """The sha256 of each data: URL's bytes in a case body, in order (computed here)."""
    found = []
    for part in body["messages"][0]["content"]:
        for kind in ("image_url", "audio_url", "video_url"):
            if kind in part:
                payload = part[kind]["url"].split(",", 1)[1]
                found.append(hashlib.sha256(base64.b64decode(payload)).hexdigest())
    return found


def test_a_multimodal_release_is_frozen_checked_and_its_media_preprocessing_guarded(
    tiny_gemma4: tuple[Path, Any, Any], tmp_path: Path
) -> None:
    checkpoint, _, _ = tiny_gemma4
    cases = json.loads(CASES.read_text())
    cases["tolerances"] |= {"latency_growth": 1e6, "throughput_drop": 1.0, "rss_growth": 1e6}
    cases["tolerances"] |= {"perf_samples": 2, "perf_tokens": 4}
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    golden = tmp_path / "golden"
    release = _plan(tmp_path, checkpoint, "release")
    freeze = ["gate", "freeze", str(release), "--cases", str(tmp_path / "cases.json")]
    assert main([*freeze, "--out", str(golden)]) == 0

    frozen = json.loads((golden / "golden.json").read_text())
    answers = {a["id"]: a for a in frozen["answers"]}
    bodies = {c["id"]: c["body"] for c in cases["cases"]}
    for case in ("image", "audio", "video", "worked-example"):
        answer = answers[case]
        assert answer["status"] == 200 and answer["usage"]["completion_tokens"] > 0, answer
        assert answer["evidence"] == _media_digests(bodies[case])
    worked = answers["worked-example"]
    assert worked["evidence"] == [answers[m]["evidence"][0] for m in ("image", "audio", "video")]
    media_tokens = {m: answers[m]["usage"]["prompt_tokens"] for m in ("image", "audio", "video")}
    assert worked["usage"]["prompt_tokens"] > max(media_tokens.values())  # all three, one prompt
    assert frozen["identity"]["processor"] is not None

    code, report = _check(tmp_path, _plan(tmp_path, checkpoint, "same"), golden, "same")
    assert code == 0 and report["passed"], report

    altered = tmp_path / "altered" / ROUTE
    shutil.copytree(checkpoint, altered)
    processor = json.loads((altered / "processor_config.json").read_text())
    assert processor["image_processor"]["max_soft_tokens"] == 70
    processor["image_processor"]["max_soft_tokens"] = 140  # images get twice the tokens
    (altered / "processor_config.json").write_text(json.dumps(processor))
    code, report = _check(tmp_path, _plan(tmp_path, altered, "altered"), golden, "altered")
    assert code == 1 and not report["passed"]
    assert _rows(report, "identity")["processor"]["detail"] == "changed"
    assert _rows(report, "identity")["weights"]["detail"] == "same"
    failed = {name for name, row in _rows(report, "case").items() if not row["passed"]}
    assert failed == WITH_AN_IMAGE, report
    for name in WITH_AN_IMAGE:
        assert "prompt_tokens" in _rows(report, "case")[name]["detail"]


@pytest.fixture(autouse=True)
def _serve_from_this_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate runs ``python -m inferd`` in the bundle: this checkout must stay importable
    there (a relative PYTHONPATH would point into the bundle)."""
    checkout = str(Path(inferd.__file__).resolve().parent.parent)
    monkeypatch.setenv("PYTHONPATH", checkout)
