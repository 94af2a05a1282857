"""Supervisor: exact readiness, artifact pinning, backoff restarts and stop escalation.

Processes here are real (small Python programs standing in for a server that fails to
start, hangs, or ignores SIGTERM); the live gate runs the real ``inferd serve``.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from inferd.bench.process import free_port
from inferd.contract.bundle import BundleError, file_sha256, publish_bundle
from inferd.contract.supervisor import (
    ArtifactMismatch,
    Executable,
    NotAdmitting,
    ReadinessState,
    RestartBudgetExhausted,
    RestartPolicy,
    StopMethod,
    Supervisor,
    assess_models,
    probe_answer,
    probe_readiness,
)
from tests.contract.helpers import inferd_plan

ROUTE = "model"


def _body(*entries: dict[str, object], obj: str = "list") -> bytes:
    return json.dumps({"object": obj, "data": list(entries)}).encode()


def _card(mid: str = ROUTE, status: str = "loaded") -> dict[str, object]:
    return {"id": mid, "object": "model", "created": 1, "owned_by": "inferd", "status": status}


@pytest.mark.parametrize(
    ("body", "state"),
    [
        (_body(_card()), ReadinessState.READY),
        (_body(_card("other"), _card()), ReadinessState.READY),
        (_body(_card(status="unloaded")), ReadinessState.UNLOADED),
        (_body(_card(status="reloading")), ReadinessState.RELOADING),
        (_body(_card(status="warming")), ReadinessState.UNKNOWN_STATUS),
        (_body({"id": ROUTE, "object": "model"}), ReadinessState.UNKNOWN_STATUS),
        (_body(_card(), _card()), ReadinessState.DUPLICATE_ROUTE),
        (_body(_card(), _card(status="unloaded")), ReadinessState.DUPLICATE_ROUTE),
        (_body(_card("other")), ReadinessState.ROUTE_MISSING),
        (_body(_card("MODEL")), ReadinessState.ROUTE_MISSING),
        (_body(), ReadinessState.ROUTE_MISSING),
        (_body(*[_card(f"m{i}") for i in range(64)], _card()), ReadinessState.TOO_MANY_MODELS),
        (_body(_card(), obj="page"), ReadinessState.NOT_LIST),
        (b'{"object":"list","data":{}}', ReadinessState.NOT_LIST),
        (b"[]", ReadinessState.NOT_LIST),
        (b"<html>ok</html>", ReadinessState.MALFORMED),
        (_body({"object": "model", "status": "loaded"}), ReadinessState.MALFORMED),
    ],
)
def test_exact_route_readiness(body: bytes, state: ReadinessState) -> None:
    readiness = assess_models(body, ROUTE)
    assert readiness.state is state
    assert readiness.ready is (state is ReadinessState.READY)


def test_sixty_four_models_are_still_readable() -> None:
    body = _body(*[_card(f"m{i}") for i in range(63)], _card())
    assert assess_models(body, ROUTE).ready


class _Handler(BaseHTTPRequestHandler):
    body = b""
    status = 200
    answer = b""  # what POST answers (the semantic probe's request)
    answer_status = 200

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        self.send_response(self.answer_status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(self.answer)))
        self.end_headers()
        self.wfile.write(self.answer)

    def do_GET(self) -> None:
        self.send_response(self.status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_models() -> Iterator[tuple[str, type[_Handler]]]:
    handler = type("H", (_Handler,), {})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_readiness_probe_bounds_the_body_and_checks_status(
    fake_models: tuple[str, type[_Handler]],
) -> None:
    url, handler = fake_models
    with httpx.Client() as client:
        handler.body = _body(_card())
        assert probe_readiness(client, url, ROUTE).ready
        handler.body = _body({**_card(), "description": "x" * 70_000})
        assert probe_readiness(client, url, ROUTE).state is ReadinessState.BODY_TOO_LARGE
        handler.status = 503
        assert probe_readiness(client, url, ROUTE).state is ReadinessState.HTTP_STATUS
        assert (
            probe_readiness(client, f"http://127.0.0.1:{free_port()}", ROUTE).state
            is ReadinessState.UNREACHABLE
        )


# -- processes ------------------------------------------------------------------------------
class FakeTime:
    """A clock that only moves when the supervisor sleeps, so backoff is checked exactly."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _supervisor(
    tmp_path: Path, script: str, *, pin: str | None = None, **kw: object
) -> tuple[Supervisor, Executable]:
    bundle = publish_bundle(
        {"model.gguf": _write(tmp_path / "model.gguf", b"GGUF")}, tmp_path / "models"
    )
    artifact = _write(tmp_path / "engine.py", script.encode())
    exe = Executable((sys.executable, str(artifact)), artifact)
    plan = inferd_plan(
        local_root=str(bundle.parent),
        bundle=bundle.name,
        artifact=pin or file_sha256(artifact),
        port=free_port(),
    )
    return Supervisor(plan, exe, log_path=tmp_path / "engine.log", **kw), exe  # type: ignore[arg-type]


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_a_process_that_keeps_dying_is_restarted_with_backoff_then_given_up(tmp_path: Path) -> None:
    t = FakeTime()
    policy = RestartPolicy(
        initial_delay_s=1.0, factor=2.0, max_delay_s=3.0, max_consecutive_failures=4
    )
    sup, _ = _supervisor(
        tmp_path, "raise SystemExit(3)\n", restart=policy, sleep=t.sleep, clock=t.clock
    )
    with sup, pytest.raises(RestartBudgetExhausted, match="4 consecutive"):
        sup.start()
    assert sup.delays == [1.0, 2.0, 3.0]  # geometric, capped, never zero
    assert [s for s in t.sleeps if s >= 1] == [1.0, 2.0, 3.0]
    assert sup.process is not None and sup.process.returncode == 3


def test_a_process_that_never_becomes_ready_is_stopped_at_the_startup_deadline(
    tmp_path: Path,
) -> None:
    t = FakeTime()
    policy = RestartPolicy(max_consecutive_failures=1)
    script = "import time\ntime.sleep(60)\n"
    sup, _ = _supervisor(
        tmp_path, script, startup_timeout_s=2.0, restart=policy, sleep=t.sleep, clock=t.clock
    )
    with sup, pytest.raises(RestartBudgetExhausted):
        sup.start()
    assert sup.process is not None and sup.process.poll() is not None  # terminated, not leaked


def test_the_pinned_artifact_and_bundle_are_verified_before_launch(tmp_path: Path) -> None:
    sup, _ = _supervisor(tmp_path, "pass\n", pin="0" * 64)
    with sup, pytest.raises(ArtifactMismatch, match="pins"):
        sup.start()
    assert sup.process is None
    other = tmp_path / "other"
    other.mkdir()
    sup, _ = _supervisor(other, "pass\n")
    model = Path(sup.plan.model.entry_path)
    model.chmod(0o644)
    model.write_bytes(b"GGUF swapped")
    with sup, pytest.raises(BundleError):
        sup.start()
    assert sup.process is None


STUBBORN = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('armed', flush=True)\n"
    "time.sleep(60)\n"
)


def _wait_for_log(sup: Supervisor, text: str) -> None:
    deadline = time.monotonic() + 30
    while text not in sup.log_tail():
        assert time.monotonic() < deadline, sup.log_tail()
        time.sleep(0.02)


def test_stop_drains_then_terminates_then_kills_and_reports_incomplete(tmp_path: Path) -> None:
    sup, _ = _supervisor(tmp_path, STUBBORN)
    sup.launch()  # the log handle and process are released by stop() below
    _wait_for_log(sup, "armed")
    with sup.track("req-in-flight"):
        report = sup.stop(drain_timeout_s=0.05, term_timeout_s=0.2)
        with pytest.raises(NotAdmitting):
            sup.track("req-late").__enter__()
    assert report.drained is False
    assert report.incomplete == ("req-in-flight",)
    assert report.method is StopMethod.KILLED
    assert report.exit_code is not None and report.exit_code < 0


def test_stop_with_nothing_in_flight_terminates_cleanly(tmp_path: Path) -> None:
    sup, _ = _supervisor(tmp_path, "print('up', flush=True)\nimport time\ntime.sleep(60)\n")
    sup.launch()
    _wait_for_log(sup, "up")
    report = sup.stop(drain_timeout_s=1.0, term_timeout_s=10.0)
    assert (report.drained, report.incomplete, report.method) == (True, (), StopMethod.TERMINATED)
    assert sup.stop().method is StopMethod.NOT_RUNNING


def test_the_semantic_probe_needs_one_token_from_the_route(
    fake_models: tuple[str, type[_Handler]],
) -> None:
    """A model listed as loaded is ready only once a known request gets one token back."""
    url, handler = fake_models
    one_token = {"model": ROUTE, "usage": {"completion_tokens": 1}}
    with httpx.Client() as client:
        handler.answer = json.dumps(one_token).encode()
        assert probe_answer(client, url, ROUTE).ready
        handler.answer = json.dumps({**one_token, "model": "other"}).encode()
        assert probe_answer(client, url, ROUTE).state is ReadinessState.NOT_ANSWERING
        handler.answer, handler.answer_status = b'{"error": {}}', 500
        failed = probe_answer(client, url, ROUTE)
        assert (failed.state, failed.detail) == (ReadinessState.NOT_ANSWERING, "HTTP 500")
