"""``inferd gate`` end to end on the default model: a plan and a golden frozen through the
real CLI, then checks of candidates served by real ``inferd serve`` processes — the unchanged
release passes; a release whose chat template, tokenizer or quantization was altered fails,
naming the cases that moved; a canary against the altered template finds it in a mirrored share
of real traffic too. The main golden's case file tolerates any speed (its checks are about the
answers); a second golden, frozen with speed tolerances, fails a release served without its KV
cache (the same answers, far slower) and passes the unchanged one."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from gguf import GGMLQuantizationType, GGUFReader

from inferd.bench.process import free_port
from inferd.cli import main
from inferd.contract.gate import Mirroring, canary
from inferd.contract.mirror import ChatAnswer, chat_answer, mirrored
from inferd.contract.plan import Toggle, plan_from_dict, plan_to_dict
from inferd.contract.rollout import LIVE, PREVIOUS, Rollout, adopt, read_plan
from inferd.contract.supervisor import Executable
from tests.contract.altered_gguf import rewrite

SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# The speed golden's tolerances: a release may take 8x the baseline's time on every latency and
# its throughput fall to an eighth, margins for an unchanged release measured while other work
# loads a 2-core machine (seen: up to 5.7x). The timed streams follow 800 words of context, one
# at a time (the plan's --max-seqs 1): without its KV cache each token recomputes those ~1,100
# tokens, some 17x the inter-token latency at 500 words on a quiet machine and about twice that
# at 800 (README, "Release gate").
SPEED_TOLERANCES = {"latency_growth": 7.0, "throughput_drop": 7 / 8, "rss_growth": 0.5}
SPEED_PHASE = {"perf_samples": 2, "perf_tokens": 8, "perf_context_words": 800}


@dataclass
class Golden:
    root: Path
    golden: Path
    model: Path


def _plan(root: Path, model: Path, name: str, *options: str) -> Path:
    out = root / f"{name}.json"
    args = ["gate", "plan", "-m", str(model), "--bundles", str(root / "bundles"), "--out", str(out)]
    assert main([*args, "--dtype", "f32", "--port", str(free_port()), *options]) == 0
    return out


def _freeze(root: Path, model: Path, cases: dict[str, Any], *options: str) -> Golden:
    (root / "cases.json").write_text(json.dumps(cases))
    plan, out = _plan(root, model, "release", *options), root / "golden"
    args = ["gate", "freeze", str(plan), "--cases", str(root / "cases.json"), "--out", str(out)]
    assert main(args) == 0
    return Golden(root, out, model)


def _check(g: Golden, plan: Path, name: str) -> tuple[int, dict[str, Any]]:
    report = g.root / f"{name}-report.json"
    code = main(["gate", "check", str(plan), str(g.golden), "--report", str(report)])
    return code, json.loads(report.read_text())


def _rows(report: dict[str, Any], kind: str) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in report["rows"] if r["kind"] == kind}


@pytest.fixture(scope="module")
def golden(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Golden:
    root = tmp_path_factory.mktemp("gate")
    cases = json.loads(Path("examples/gate/cases.json").read_text())
    cases["tolerances"] |= {"latency_growth": 1e6, "throughput_drop": 1.0, "rss_growth": 1e6}
    cases["tolerances"] |= {"perf_samples": 2, "perf_tokens": 4}
    return _freeze(root, smollm2_gguf, cases)


@pytest.fixture(scope="module")
def speed_golden(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Golden:
    """The default model frozen with speed tolerances and two greedy cases, served one stream
    at a time (the throughput phase's concurrency is the plan's --max-seqs)."""
    cases = json.loads(Path("examples/gate/cases.json").read_text())
    cases["tolerances"] |= SPEED_TOLERANCES | SPEED_PHASE
    cases["cases"] = [c for c in cases["cases"] if c["id"] in ("capital", "story")]
    return _freeze(tmp_path_factory.mktemp("gate-speed"), smollm2_gguf, cases, "--max-seqs", "1")


def test_the_golden_holds_answers_identity_and_figures(golden: Golden) -> None:
    frozen = json.loads((golden.golden / "golden.json").read_text())
    answers = {a["id"]: a for a in frozen["answers"]}
    assert answers["capital"]["status"] == 200 and "Paris" in answers["capital"]["text"]
    assert answers["json-schema"]["schema_valid"] is True
    assert answers["tool-call"]["finish_reason"] == "tool_calls"
    assert answers["tool-call"]["tool_calls"][0]["name"] == "get_weather"
    assert answers["adversarial-temperature"]["status"] == 400
    for media, digests in (("image", 1), ("audio", 1), ("video", 1), ("worked-example", 3)):
        refused = answers[media]  # a text model refuses media before reading it
        assert refused["status"] == 400 and len(refused["evidence"]) == digests, refused
    assert all(
        0 < len(a["logprobs"]) <= a["usage"]["completion_tokens"]  # the end token: none
        for a in answers.values()
        if a["text"] is not None  # a tool call's tokens carry no content log-probs
    )
    assert set(frozen["identity"]) == {
        "weights",
        "tokenizer",
        "chat_template",
        "processor",
        "quantization",
    }
    perf = frozen["performance"]
    assert perf["cold_load_s"] > 0 and perf["throughput_tok_s"] > 0 and perf["peak_rss_mb"] > 100
    assert frozen["environment"]["dtype"] == "float32"


def test_the_unchanged_release_passes(golden: Golden) -> None:
    code, report = _check(golden, _plan(golden.root, golden.model, "same"), "same")
    assert code == 0 and report["passed"], report
    assert all(r["detail"] == "same" for r in _rows(report, "identity").values())


def _pirate_template(g: Golden) -> Path:
    """The release's GGUF with another system prompt in its chat template (written once)."""
    altered = g.root / "template" / g.model.name
    if not altered.exists():
        template = GGUFReader(str(g.model)).fields["tokenizer.chat_template"].contents()
        assert SMOLLM_SYSTEM in template
        altered.parent.mkdir()
        new = template.replace(SMOLLM_SYSTEM, "You are a pirate.")
        rewrite(g.model, altered, metadata={"tokenizer.chat_template": new})
    return altered


def test_an_altered_chat_template_fails_naming_the_cases(golden: Golden) -> None:
    altered = _pirate_template(golden)
    code, report = _check(golden, _plan(golden.root, altered, "template"), "template")
    assert code == 1 and not report["passed"]
    identity = _rows(report, "identity")
    assert (
        identity["chat_template"]["detail"] == "changed" and identity["weights"]["detail"] == "same"
    )
    cases = _rows(report, "case")
    assert not cases["capital"]["passed"] and "prompt_tokens" in cases["capital"]["detail"]
    assert cases["story"]["passed"], cases["story"]  # it has its own system prompt
    assert cases["adversarial-temperature"]["passed"]


def test_an_altered_tokenizer_fails(golden: Golden) -> None:
    merges = GGUFReader(str(golden.model)).fields["tokenizer.ggml.merges"].contents()
    altered = golden.root / "tokenizer" / golden.model.name
    altered.parent.mkdir()
    rewrite(golden.model, altered, metadata={"tokenizer.ggml.merges": merges[300:]})
    code, report = _check(golden, _plan(golden.root, altered, "tokenizer"), "tokenizer")
    assert code == 1
    assert _rows(report, "identity")["tokenizer"]["detail"] == "changed"
    failed = [name for name, row in _rows(report, "case").items() if not row["passed"]]
    assert "capital" in failed and "prompt_tokens" in _rows(report, "case")["capital"]["detail"]


def test_a_sigterm_ends_the_gate_and_the_server_it_started(golden: Golden) -> None:
    """`inferd gate check` sent SIGTERM while its release answers: it stops the server it
    started on the way out, as on Ctrl-C (once, SIGTERM ended the gate and left it running)."""
    path = _plan(golden.root, golden.model, "sigterm")
    health = plan_from_dict(json.loads(path.read_text())).base_url + "/health"
    command = [sys.executable, "-m", "inferd", "gate", "check", str(path), str(golden.golden)]
    command += ["--report", str(golden.root / "sigterm-report.json")]
    log = golden.root / "sigterm-gate.log"
    with log.open("wb") as out:
        gate = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while not _answers(health):
                assert gate.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "no server came up"
                time.sleep(0.5)
            gate.send_signal(signal.SIGTERM)
            assert gate.wait(timeout=120) == 130, log.read_text()  # as a Ctrl-C ends it
        finally:
            gate.kill()
            gate.wait()
    assert not _answers(health)  # the release is stopped, not orphaned


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def test_a_requantized_release_fails(golden: Golden) -> None:
    altered = golden.root / "q4_0" / golden.model.name
    altered.parent.mkdir()
    rewrite(
        golden.model, altered, requantize=(GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_0)
    )
    code, report = _check(golden, _plan(golden.root, altered, "q4_0"), "q4_0")
    assert code == 1
    identity = _rows(report, "identity")
    assert (
        identity["quantization"]["detail"] == "changed"
        and identity["tokenizer"]["detail"] == "same"
    )
    moved = [row["detail"] for row in _rows(report, "case").values() if not row["passed"]]
    assert moved and all("moved" in d or "log-prob distance" in d for d in moved), moved


def test_a_canary_then_a_promotion_keeps_the_previous_release_ready(golden: Golden) -> None:
    """Two plans of the same model served at once: the canary passes; after the promotion
    both stay served, so the rollback switches to a process that never stopped."""
    old_path, new_path = (_plan(golden.root, golden.model, n) for n in ("old", "new"))
    report = golden.root / "canary.json"
    args = [
        "gate",
        "canary",
        str(old_path),
        str(new_path),
        "--cases",
        str(golden.root / "cases.json"),
    ]
    assert main([*args, "--report", str(report), "--logs", str(golden.root)]) == 0
    passed = json.loads(report.read_text())
    old, new = (plan_from_dict(json.loads(p.read_text())) for p in (old_path, new_path))
    assert passed["passed"] and passed["candidate_plan_sha256"] == new.identity_sha256()

    state = golden.root / "rollout"
    adopt(state, old)
    rollout = Rollout(state, Executable.inferd_module(), golden.root)
    try:
        rollout.start()
        standby = rollout.running[old.identity_sha256()].process
        rollout.promote(new, passed)
        assert read_plan(state, LIVE) == new and read_plan(state, PREVIOUS) == old
        assert all(s.alive() for s in rollout.running.values()) and len(rollout.running) == 2
        assert rollout.rollback() == old and read_plan(state, LIVE) == old
        assert rollout.running[old.identity_sha256()].process is standby  # never restarted
        answer = httpx.post(
            old.base_url + "/v1/chat/completions",
            json={"model": old.model_route, "messages": [{"role": "user", "content": "Hi"}]},
            timeout=120,
        )
        assert answer.status_code == 200
    finally:
        rollout.stop()
    assert not rollout.running


def test_a_canary_mirrors_a_share_of_traffic_and_finds_the_altered_template(
    golden: Golden,
) -> None:
    """Real traffic through the canary's proxy: every caller gets the live release's answer
    (the same as asking it directly), the requests the digest picks are mirrored to the
    candidate, and each of them shows the candidate's other chat template."""
    old, new = (
        plan_from_dict(json.loads(_plan(golden.root, model, name).read_text()))
        for model, name in ((golden.model, "mirror-old"), (_pirate_template(golden), "mirror-new"))
    )
    sent: dict[str, bytes] = {}

    def traffic(url: str) -> None:
        with httpx.Client(trust_env=False, timeout=300) as client:
            for i in range(8):
                body = {
                    "model": old.model_route,
                    "messages": [{"role": "user", "content": f"Name a colour, then count to {i}."}],
                    "max_tokens": 6,
                    "temperature": 0,
                }
                if i % 2 == 0:  # streamed, with the usage chunk that counts the prompt
                    body |= {"stream": True, "stream_options": {"include_usage": True}}
                rid = f"mirror-{i}"
                sent[rid] = json.dumps(body).encode()
                answers = [_chat(client, base, sent[rid], rid) for base in (url, old.base_url)]
                assert answers[0] == answers[1] and answers[0].status == 200, answers

    # One case: the canary's case comparison has its own tests; this one is the traffic's.
    cases = json.loads((golden.root / "cases.json").read_text())
    one_case = golden.root / "mirror-cases.json"
    one_case.write_text(json.dumps(cases | {"cases": cases["cases"][:1]}))
    report = canary(
        old, new, Executable.inferd_module(), one_case, golden.root, Mirroring(0.5, traffic)
    )
    rows = {r.name: r for r in report.rows if r.kind == "mirror"}
    expected = {rid for rid, data in sent.items() if mirrored(data, 0.5)}
    assert 0 < len(expected) < len(sent) and set(rows) == expected | {"mirrored share"}
    for rid in expected:
        assert not rows[rid].passed and "prompt_tokens" in rows[rid].detail, rows[rid]
    assert rows["mirrored share"].detail.startswith(f"{len(expected)} of 8 chat requests")
    assert not report.passed


def _chat(client: httpx.Client, base: str, body: bytes, rid: str) -> ChatAnswer:
    headers = {"content-type": "application/json", "x-request-id": rid}
    response = client.post(base + "/v1/chat/completions", content=body, headers=headers)
    content_type = response.headers.get("content-type", "")
    return chat_answer(response.status_code, content_type, response.content)


def test_the_unchanged_release_passes_the_speed_gate(speed_golden: Golden) -> None:
    plan = _plan(speed_golden.root, speed_golden.model, "same", "--max-seqs", "1")
    code, report = _check(speed_golden, plan, "same")
    assert code == 0 and report["passed"], report
    performance = _rows(report, "performance")  # every figure measured and bounded
    assert len(performance) == 8 and all("bound" in r["detail"] for r in performance.values())


def test_a_release_without_its_kv_cache_fails_the_speed_gate_alone(speed_golden: Golden) -> None:
    """The same model and greedy answers, served with --no-kv-cache: every case passes and the
    performance rows that fail are the speed the cache gave, each with its ratio and bound."""
    path = _plan(speed_golden.root, speed_golden.model, "no-kv-cache", "--max-seqs", "1")
    plan = plan_from_dict(json.loads(path.read_text()))
    limits = dataclasses.replace(plan.limits, no_kv_cache=True, prefix_caching=Toggle.OFF)
    path.write_text(json.dumps(plan_to_dict(dataclasses.replace(plan, limits=limits))))
    code, report = _check(speed_golden, path, "no-kv-cache")
    log = (speed_golden.golden / "candidate.log").read_text()
    assert "no KV cache (--no-kv-cache)" in log  # the candidate served the slow path
    assert code == 1 and not report["passed"]
    assert all(row["passed"] for row in _rows(report, "case").values()), report
    assert all(row["detail"] == "same" for row in _rows(report, "identity").values())
    failed = {r["name"]: r["detail"] for r in report["rows"] if not r["passed"]}
    assert {"itl_p50_s", "throughput_tok_s"} <= set(failed), report
    assert set(failed) <= set(_rows(report, "performance"))
    for detail in failed.values():
        assert "x; bound" in detail, detail
