"""The live acceptance gate: the contract against a real ``inferd serve`` on the default model.

One server for the module, launched by the Supervisor from a pinned plan (distribution
digest, digest-addressed bundle, loopback, explicit limits, JSON access logs on stderr, which
the last test reads back for the request ids sent). Frozen text requests go out
through the request builder and come back through the strict consumer; receipts are
written and re-verified. Then the hostile cases: a client that drops mid-stream (its usage
reconciled with the server's access log), a slow consumer, a server killed mid-stream (and
restarted with backoff), and a stop with a stream still in flight. The tests run in file
order and share the server.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

import inferd
from inferd.bench.process import free_port
from inferd.contract.bundle import artifact_sha256, publish_bundle
from inferd.contract.canonical import canonical_json
from inferd.contract.client import open_chat_stream
from inferd.contract.fixtures import tiny_png
from inferd.contract.plan import AccessLog, LaunchPlan
from inferd.contract.receipts import (
    read_receipt,
    request_receipt,
    stream_receipt,
    write_receipt,
)
from inferd.contract.reconcile import reconcile, server_record
from inferd.contract.request import (
    ChatRequest,
    MediaPart,
    RequestBounds,
    TextPart,
    build_chat_request,
)
from inferd.contract.retry import LengthRetryPolicy, retry_length_limited
from inferd.contract.staging import EvidenceStore, Modality
from inferd.contract.stream import (
    CallerCancelled,
    Complete,
    ConnectionDropped,
    IncompleteLengthLimited,
    Outcome,
    ProtocolError,
    Rule,
    ServerCancelled,
    StreamLimits,
    ToolCallsRequested,
    UsageSource,
    outcome_text,
)
from inferd.contract.supervisor import (
    Executable,
    ReadinessState,
    RestartPolicy,
    StartReport,
    StopMethod,
    Supervisor,
    SupervisorError,
    assess_models,
)
from inferd.store import CATALOG, DEFAULT_MODEL
from tests.contract.helpers import inferd_plan

TEXT_ONLY = RequestBounds(
    max_prompt_bytes=2048,
    max_media_parts=0,
    max_media_bytes=0,
    max_output_tokens=512,
    max_json_bytes=8192,
    modalities=frozenset({Modality.TEXT}),
)
# Generous time bounds: this is a shared 2-core machine, and the gate is about protocol.
LIMITS = StreamLimits(idle_timeout_s=120, total_timeout_s=600)
FROZEN = {
    "gate-capital": ("What is the capital of France? Answer in one short sentence.", 64),
    "gate-greeting": ("Say hello to a new colleague in one sentence.", 64),
}
LONG_PROMPT = "Write a very long, detailed story about a lighthouse keeper and a storm."


@dataclass
class Gate:
    plan: LaunchPlan
    supervisor: Supervisor
    client: httpx.Client
    receipts: Path
    started: StartReport
    texts: dict[str, str] = field(default_factory=dict)
    sent: list[str] = field(default_factory=list)
    measured: dict[str, object] = field(default_factory=dict)


@pytest.fixture(scope="module")
def gate(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gate]:
    root = tmp_path_factory.mktemp("contract-live")
    bundle = publish_bundle({smollm2_gguf.name: smollm2_gguf}, root / "models")
    # The engine runs from a published copy of this checkout, pinned by digest, so the
    # restart below launches exactly what the first start did.
    exe = Executable.published_inferd(root / "engine")
    plan = inferd_plan(
        local_root=str(bundle.parent),
        bundle=bundle.name,
        artifact=artifact_sha256(exe.artifact),
        entry=smollm2_gguf.name,
        port=free_port(),
        version=inferd.__version__,
        revision="sha256:" + CATALOG[DEFAULT_MODEL].files[0].sha256,
        access_log=AccessLog.JSON,
    )
    assert plan.model.local_dir == str(bundle)
    supervisor = Supervisor(
        plan,
        exe,
        log_path=root / "serve.log",
        startup_timeout_s=300,
        restart=RestartPolicy(initial_delay_s=0.5, max_consecutive_failures=3),
    )
    with supervisor, httpx.Client(trust_env=False) as client:
        try:
            started = supervisor.start()
        except SupervisorError as exc:
            pytest.fail(f"{exc}\n{supervisor.log_tail()}")
        gate = Gate(plan, supervisor, client, root / "receipts", started)
        yield gate
        print("\nlive gate measurements:", json.dumps(gate.measured, indent=1, sort_keys=True))


def _request(gate: Gate, rid: str, prompt: str, max_tokens: int) -> ChatRequest:
    return build_chat_request(
        gate.plan,
        request_id=rid,
        tenant="gate",
        parts=(TextPart(prompt),),
        max_tokens=max_tokens,
        temperature=0.0,
        seed=7,
        bounds=TEXT_ONLY,
    )


def _record(
    gate: Gate, request: ChatRequest, stream: object, outcome: Outcome
) -> dict[str, object]:
    """Write the request and stream receipts, then read them back through their digests."""
    from inferd.contract.client import LiveStream

    assert isinstance(stream, LiveStream)
    req = write_receipt(gate.receipts, request_receipt(gate.plan, request))
    got = write_receipt(gate.receipts, stream_receipt(gate.plan, request, stream.consumer, outcome))
    assert read_receipt(req)["request_sha256"] == request.sha256
    gate.sent.append(request.request_id)
    return read_receipt(got)


def _send(gate: Gate, rid: str, prompt: str, max_tokens: int, pause_s: float = 0.0) -> Outcome:
    return _send_request(gate, _request(gate, rid, prompt, max_tokens), pause_s)


def _send_request(gate: Gate, request: ChatRequest, pause_s: float = 0.0) -> Outcome:
    rid = request.request_id
    started = time.monotonic()
    with (
        gate.supervisor.track(rid),
        open_chat_stream(gate.client, gate.plan.base_url, request, LIMITS) as stream,
    ):
        reads = 0
        while stream.pump():
            reads += 1
            time.sleep(pause_s)
        outcome = stream.run()
        assert stream.head.request_id == rid  # echoed, and checked by the consumer too
        receipt = _record(gate, request, stream, outcome)
    gate.measured[rid] = {
        "outcome": str(outcome.kind),
        "seconds": round(time.monotonic() - started, 2),
        "reads": reads,
        "wire_bytes": receipt["wire_bytes"],
        "events": receipt["events"],
        "usage": receipt["usage"],
    }
    return outcome


def _running(gate: Gate) -> float:
    body = gate.client.get(gate.plan.base_url + "/metrics").text
    prefix = f'inferd_requests_running{{model="{gate.plan.model_route}"}} '
    return float(next(line for line in body.splitlines() if line.startswith(prefix)).split()[-1])


def test_exact_readiness_after_startup(gate: Gate) -> None:
    sup = gate.supervisor
    assert gate.started.readiness.ready and sup.alive()
    assert sup.readiness().state is ReadinessState.READY
    body = gate.client.get(gate.plan.base_url + "/v1/models").content
    assert assess_models(body, gate.plan.model_route).ready
    assert not assess_models(body, gate.plan.model_route + "-other").ready
    gate.measured["startup_s"] = round(gate.started.startup_s, 2)
    gate.measured["serve_identity"] = gate.plan.identity_sha256()


def test_the_plan_leaves_no_chat_page_and_no_lifecycle_routes(gate: Gate) -> None:
    """On loopback, inferd's defaults would serve the chat page and the lifecycle and LoRA
    routes without a key; the plan turns them off explicitly."""
    base = gate.plan.base_url
    assert gate.client.get(base + "/").status_code == 404
    body = {"model_id": gate.plan.model_route}
    for route in ("/v1/models/status", "/v1/models/unload", "/v1/load_lora_adapter"):
        assert gate.client.post(base + route, json=body).status_code == 404, route
    assert gate.client.get(base + "/v1/models").status_code == 200


@pytest.mark.parametrize("rid", list(FROZEN))
def test_frozen_requests_complete(gate: Gate, rid: str) -> None:
    prompt, max_tokens = FROZEN[rid]
    outcome = _send(gate, rid, prompt, max_tokens)
    assert isinstance(outcome, Complete), outcome
    assert outcome.model == gate.plan.model_route and outcome.text.strip()
    assert outcome.usage is not None and 0 < outcome.usage.completion_tokens <= max_tokens
    gate.texts[rid] = outcome.text


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.mark.parametrize(
    "choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"]
)
def test_streamed_tool_calls_come_whole_with_json_arguments(
    gate: Gate, choice: str | dict[str, object]
) -> None:
    """The real server's streamed tool calls pass the strict assembler: one call per index,
    named once, its arguments one JSON object that matches the function's schema."""
    request = build_chat_request(
        gate.plan,
        request_id=f"gate-tools-{'named' if isinstance(choice, dict) else choice}",
        tenant="gate",
        parts=(TextPart("What is the weather in Paris?"),),
        max_tokens=64,
        temperature=0.0,
        seed=7,
        bounds=TEXT_ONLY,
        tools=(WEATHER,),
        tool_choice=choice,
    )
    with open_chat_stream(gate.client, gate.plan.base_url, request, LIMITS) as stream:
        outcome = stream.run()
        _record(gate, request, stream, outcome)
    assert isinstance(outcome, ToolCallsRequested), outcome
    assert outcome.calls and all(c.name == "get_weather" for c in outcome.calls)
    assert all(isinstance(c.arguments.get("city"), str) for c in outcome.calls)
    assert [c.index for c in outcome.calls] == list(range(len(outcome.calls)))


def test_a_frozen_request_at_its_token_cap_is_length_limited(gate: Gate) -> None:
    outcome = _send(gate, "gate-capped", LONG_PROMPT, 4)
    assert isinstance(outcome, IncompleteLengthLimited) and not outcome.ok
    assert outcome.usage is not None and outcome.usage.completion_tokens == 4 and outcome.text


def test_a_length_limited_run_is_retried_as_new_runs_within_the_policy(gate: Gate) -> None:
    """Greedy on the same input, each larger budget extends the same answer; the policy
    stops at its ceiling and the outcome stays length-limited, never passed off as complete."""
    policy = LengthRetryPolicy(allowed=True, ceiling=16, max_runs=3)
    run = retry_length_limited(
        lambda rid, budget: _request(gate, rid, LONG_PROMPT, budget),
        lambda request: _send_request(gate, request),
        request_id="gate-retry",
        max_tokens=4,
        policy=policy,
    )
    assert [(r.request_id, r.max_tokens) for r in run.runs] == [
        ("gate-retry", 4),
        ("gate-retry-r1", 8),
        ("gate-retry-r2", 16),
    ]
    outcomes = [r.outcome for r in run.runs]
    assert all(isinstance(o, IncompleteLengthLimited) for o in outcomes), outcomes
    texts = [outcome_text(o) for o in outcomes]
    assert texts[0] and texts[1].startswith(texts[0]) and texts[2].startswith(texts[1])
    assert not run.outcome.ok


def test_receipts_are_on_disk_and_verified(gate: Gate) -> None:
    receipts = [read_receipt(p) for p in sorted(gate.receipts.iterdir())]
    for kind in ("request", "stream"):
        ids = sorted(r["request_id"] for r in receipts if r["kind"] == kind)
        assert ids == sorted(gate.sent), kind
    identity = gate.plan.identity_sha256()
    assert {r["serve_identity"] for r in receipts} == {identity}


def test_refusals_keep_only_a_sanitized_body_prefix(gate: Gate, tmp_path: Path) -> None:
    store = EvidenceStore(tmp_path / "evidence")
    store.stage("gate", "img", tiny_png(), locator="camera-1/frame-7")
    lease = store.lease("gate", "gate-image", "img")
    with_images = dataclasses.replace(
        TEXT_ONLY,
        max_media_parts=1,
        max_media_bytes=1 << 20,
        modalities=frozenset({Modality.TEXT, Modality.IMAGE}),
    )
    image = build_chat_request(
        gate.plan,
        request_id="gate-image",
        tenant="gate",
        parts=(MediaPart(lease), TextPart("Describe the image.")),
        max_tokens=16,
        temperature=0.0,
        seed=7,
        bounds=with_images,
        store=store,
    )
    text = _request(gate, "gate-wrong-route", "Hello.", 16)
    body = json.loads(text.body)
    body["model"] = "no-such-model"
    wrong_route = dataclasses.replace(text, body=canonical_json(body), model_route="no-such-model")
    for request, status in ((image, 400), (wrong_route, 404)):
        with open_chat_stream(gate.client, gate.plan.base_url, request, LIMITS) as stream:
            outcome = stream.run()
        assert isinstance(outcome, ProtocolError) and outcome.rule is Rule.HTTP_STATUS, outcome
        assert outcome.detail.startswith(f"HTTP {status}: ") and len(outcome.detail) <= 220
        assert "file://" not in outcome.detail and outcome.partial_text == ""
        gate.measured[request.request_id] = outcome.detail


def test_client_drop_mid_stream_is_reconciled_with_the_servers_record(gate: Gate) -> None:
    """The caller cancels once three tokens have arrived. The server aborts the sequence, and
    its access log records the disconnect with at least the tokens the caller counted (the
    difference: tokens generated after its last read), within max_tokens, and the prompt tokens
    a complete run of the same prompt was billed."""
    request = _request(gate, "gate-drop", LONG_PROMPT, 256)
    with open_chat_stream(gate.client, gate.plan.base_url, request, LIMITS) as stream:
        while stream.consumer.tokens_received < 3 and stream.pump():
            pass
        outcome = stream.cancel()
        _record(gate, request, stream, outcome)
    assert isinstance(outcome, CallerCancelled) and outcome.partial_text and not outcome.ok
    assert outcome.usage_source is UsageSource.RECEIVED and outcome.completion_tokens >= 3
    # The server notices the dropped connection and aborts the sequence.
    dropped = time.monotonic()
    deadline = dropped + 120
    while _running(gate) != 0:
        assert time.monotonic() < deadline, "the dropped request was never aborted"
        time.sleep(0.05)
    gate.measured["drop_to_abort_s"] = round(time.monotonic() - dropped, 3)
    assert gate.supervisor.readiness().ready
    log = gate.supervisor.log_path
    while (record := server_record(log.read_text("utf-8"), "gate-drop")) is None:
        assert time.monotonic() < deadline, "the server never logged the dropped request's end"
        time.sleep(0.05)
    reconciled = reconcile(outcome, record, request.max_tokens)
    assert reconciled.consistent, reconciled.problems
    assert record.outcome == "client_disconnected" and reconciled.undelivered is not None
    assert reconciled.server_tokens is not None and reconciled.server_tokens < request.max_tokens
    capped = gate.measured["gate-capped"]
    assert isinstance(capped, dict) and isinstance(capped["usage"], dict)
    assert record.prompt_tokens == capped["usage"]["prompt_tokens"]
    gate.measured["drop_reconciled"] = {
        "client_tokens": reconciled.client_tokens,
        "server_tokens": reconciled.server_tokens,
        "undelivered": reconciled.undelivered,
    }


def test_slow_consumer_gets_the_same_complete_answer(gate: Gate) -> None:
    rid = next(iter(FROZEN))
    prompt, max_tokens = FROZEN[rid]
    outcome = _send(gate, "gate-slow", prompt, max_tokens, pause_s=0.05)
    assert isinstance(outcome, Complete) and outcome.text == gate.texts[rid]


def test_server_killed_mid_stream_is_incomplete_then_restarted(gate: Gate) -> None:
    sup = gate.supervisor
    request = _request(gate, "gate-killed", LONG_PROMPT, 256)
    with open_chat_stream(gate.client, gate.plan.base_url, request, LIMITS) as stream:
        while not stream.text and stream.pump():
            pass
        sup.kill()
        outcome = stream.run()
        _record(gate, request, stream, outcome)
    assert isinstance(outcome, ConnectionDropped) and not outcome.ok, outcome
    assert outcome.partial_text and outcome.usage_source is UsageSource.RECEIVED
    gate.measured["killed_outcome"] = f"{outcome.kind}: {outcome.detail}"
    assert not sup.alive() and sup.readiness().state is ReadinessState.UNREACHABLE

    restarted = sup.watch_once()  # liveness failed: restarted, with the backoff
    assert restarted is not None and restarted.readiness.ready and sup.delays == [0.5]
    assert sup.watch_once() is None  # alive: nothing to do
    gate.measured["restart_s"] = round(restarted.startup_s, 2)
    rid = next(iter(FROZEN))
    again = _send(gate, "gate-after-restart", *FROZEN[rid])
    assert isinstance(again, Complete) and again.text == gate.texts[rid]


def test_stop_with_a_stream_in_flight_reports_it(gate: Gate) -> None:
    sup = gate.supervisor
    request = _request(gate, "gate-stopped", LONG_PROMPT, 512)
    with (
        sup.track(request.request_id),
        open_chat_stream(gate.client, gate.plan.base_url, request, LIMITS) as stream,
    ):
        while not stream.text and stream.pump():
            pass
        report = sup.stop(drain_timeout_s=0.2, term_timeout_s=2.0)
        outcome = stream.run()
    assert report.incomplete == ("gate-stopped",) and not report.drained
    assert report.method in (StopMethod.TERMINATED, StopMethod.KILLED)
    # the supervisor kills the server before its own drain (30 s) would cut the stream
    assert isinstance(outcome, ConnectionDropped | ServerCancelled) and not outcome.ok, outcome
    gate.measured["stop"] = {"method": str(report.method), "outcome": str(outcome.kind)}


# What a JSON access line may carry: ids, routes, status, timing and token counts, no bodies.
ACCESS_FIELDS = {"ts", "event", "request_id", "method", "route", "status", "duration_ms"} | {
    "model", "prompt_tokens", "completion_tokens", "outcome", "error"
}  # fmt: skip
CHAT_ROUTE = "/v1/chat/completions"


def test_json_access_log_carries_the_gate_request_ids_and_no_prompt_text(gate: Gate) -> None:
    """The plan asked for ``--access-log-format json``: every line the gate can attribute is
    a JSON object naming the x-request-id it sent, and no prompt text reaches the log."""
    log = gate.supervisor.log_path.read_text("utf-8")
    records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert records and all(set(r) <= ACCESS_FIELDS for r in records), records[:3]
    starts = {r["request_id"]: r for r in records if r["event"] == "request_start"}
    ends = {r["request_id"]: r for r in records if r["event"] == "request_end"}
    for rid in [*gate.sent, "gate-image", "gate-wrong-route", "gate-stopped"]:
        assert starts[rid]["route"] == CHAT_ROUTE and starts[rid]["method"] == "POST", rid
    complete = {
        rid: m["usage"]
        for rid, m in gate.measured.items()
        if isinstance(m, dict) and m.get("outcome") == "complete"
    }
    assert set(FROZEN) | {"gate-slow", "gate-after-restart"} <= set(complete)
    for rid, usage in complete.items():
        end = ends[rid]
        assert (end["status"], end["outcome"], end["model"]) == (
            200,
            "complete",
            gate.plan.model_route,
        )
        assert isinstance(usage, dict)
        assert (end["prompt_tokens"], end["completion_tokens"]) == (
            usage["prompt_tokens"],
            usage["completion_tokens"],
        )
    assert (ends["gate-image"]["status"], ends["gate-wrong-route"]["status"]) == (400, 404)
    for prompt in [*(p for p, _ in FROZEN.values()), LONG_PROMPT, "Describe the image."]:
        assert prompt not in log
    gate.measured["access_lines"] = len(records)
