"""Run one serving process from a launch plan: startup, liveness, exact readiness, restarts, stop.

Three probes answer three questions. Startup: did the process load before a generous
deadline? Liveness (``/health``): is the process answering at all? Readiness
(``/v1/models``): is the exact route listed once, ``loaded``? A 200 from ``/health`` says
nothing about the model, and another loaded model does not make this route ready.

Restarts back off geometrically and give up after a bounded number of failures, so a bad
artifact is never reloaded in a tight loop. Stopping drains tracked requests to a
deadline, then terminates, then kills, and reports what was still in flight.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import IO, Any

import httpx

from inferd.contract.bundle import artifact_sha256, publish_bundle, tree_files, verify_bundle
from inferd.contract.plan import LaunchPlan

MODELS_PATH = "/v1/models"
HEALTH_PATH = "/health"


class SupervisorError(RuntimeError):
    pass


class ArtifactMismatch(SupervisorError):
    """The executable or distribution on disk is not the one the plan pinned."""


class StartupFailed(SupervisorError):
    """The process exited, or was not ready before the startup deadline."""


class RestartBudgetExhausted(SupervisorError):
    """Too many consecutive failed starts; a person should look before the next one."""


class NotAdmitting(SupervisorError):
    """The supervisor is stopping and takes no new requests."""


# -- readiness ---------------------------------------------------------------------------------
class ReadinessState(StrEnum):
    READY = "ready"
    UNREACHABLE = "unreachable"
    HTTP_STATUS = "http_status"
    BODY_TOO_LARGE = "body_too_large"
    MALFORMED = "malformed"
    NOT_LIST = "not_list"
    TOO_MANY_MODELS = "too_many_models"
    ROUTE_MISSING = "route_missing"
    DUPLICATE_ROUTE = "duplicate_route"
    UNLOADED = "unloaded"
    RELOADING = "reloading"
    UNKNOWN_STATUS = "unknown_status"
    NOT_ANSWERING = "not_answering"  # listed as loaded, but the known request failed


@dataclass(frozen=True)
class Readiness:
    state: ReadinessState
    detail: str = ""

    @property
    def ready(self) -> bool:
        return self.state is ReadinessState.READY


MAX_MODELS_BODY = 64 << 10
MAX_MODEL_ENTRIES = 64


def assess_models(body: bytes, route: str, *, max_entries: int = MAX_MODEL_ENTRIES) -> Readiness:
    """Readiness of ``route`` from a ``/v1/models`` body (already bounded by the caller)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return Readiness(ReadinessState.MALFORMED, "the body is not JSON")
    if (
        not isinstance(doc, dict)
        or doc.get("object") != "list"
        or not isinstance(doc.get("data"), list)
    ):
        return Readiness(ReadinessState.NOT_LIST, 'expected {"object": "list", "data": [...]}')
    entries = doc["data"]
    if len(entries) > max_entries:
        return Readiness(ReadinessState.TOO_MANY_MODELS, f"{len(entries)} models listed")
    if not all(isinstance(e, dict) and isinstance(e.get("id"), str) for e in entries):
        return Readiness(ReadinessState.MALFORMED, "every model needs a string id")
    matches = [e for e in entries if e["id"] == route]
    if not matches:
        others = sum(1 for e in entries if e.get("status") == "loaded")
        return Readiness(ReadinessState.ROUTE_MISSING, f"route absent; {others} other loaded")
    if len(matches) > 1:
        return Readiness(ReadinessState.DUPLICATE_ROUTE, f"route listed {len(matches)} times")
    return _status_readiness(matches[0].get("status"))


def _status_readiness(status: object) -> Readiness:
    if status == "loaded":
        return Readiness(ReadinessState.READY)
    if status == "unloaded":
        return Readiness(ReadinessState.UNLOADED)
    if status == "reloading":
        return Readiness(ReadinessState.RELOADING)
    return Readiness(ReadinessState.UNKNOWN_STATUS, f"status {str(status)[:32]!r}")


def probe_readiness(client: httpx.Client, base_url: str, route: str) -> Readiness:
    """GET /v1/models, reading at most MAX_MODELS_BODY bytes."""
    try:
        with client.stream("GET", base_url + MODELS_PATH) as response:
            if response.status_code != 200:
                return Readiness(ReadinessState.HTTP_STATUS, f"HTTP {response.status_code}")
            body = bytearray()
            for chunk in response.iter_raw():
                body += chunk
                if len(body) > MAX_MODELS_BODY:
                    return Readiness(ReadinessState.BODY_TOO_LARGE, f"over {MAX_MODELS_BODY} bytes")
    except httpx.TransportError as exc:
        return Readiness(ReadinessState.UNREACHABLE, type(exc).__name__)
    return assess_models(bytes(body), route)


# The semantic probe: one token of a fixed request, before the route counts as ready. A
# server can list a model as loaded and still fail every request (a broken template, kernels
# that crash on first use); the probe sees what a first caller would.
PROBE_BODY = {"messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 1}


def probe_answer(client: httpx.Client, base_url: str, route: str) -> Readiness:
    """POST the probe request to ``route``: ready when it answers one token under its id."""
    try:
        response = client.post(
            base_url + "/v1/chat/completions", json={**PROBE_BODY, "model": route}
        )
    except httpx.TransportError as exc:
        return Readiness(ReadinessState.NOT_ANSWERING, type(exc).__name__)
    if response.status_code != 200:
        return Readiness(ReadinessState.NOT_ANSWERING, f"HTTP {response.status_code}")
    try:
        doc = response.json()
        answered = doc["model"] == route and doc["usage"]["completion_tokens"] == 1
    except (ValueError, KeyError, TypeError):
        answered = False
    if not answered:
        return Readiness(ReadinessState.NOT_ANSWERING, "not one token from the route")
    return Readiness(ReadinessState.READY)


def probe_liveness(client: httpx.Client, base_url: str) -> bool:
    try:
        return client.get(base_url + HEALTH_PATH).status_code == 200
    except httpx.TransportError:
        return False


# -- launching ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Executable:
    """How to run the engine, and which file or tree its pinned digest covers."""

    argv_prefix: tuple[str, ...]
    artifact: Path
    cwd: Path | None = None
    env: tuple[tuple[str, str], ...] = ()  # added to the supervisor's environment

    @classmethod
    def inferd_module(cls) -> Executable:
        """This interpreter running the installed ``inferd`` package, in place."""
        import inferd

        return cls((sys.executable, "-m", "inferd"), Path(inferd.__file__).parent)

    @classmethod
    def published_inferd(cls, root: Path) -> Executable:
        """A read-only, digest-addressed copy of the ``inferd`` package, run from there.

        The copy is the immutable release: edits to the working tree after publishing do
        not change what a restart launches, and the pinned digest keeps matching.
        """
        import inferd

        source = Path(inferd.__file__).parent
        release = publish_bundle(tree_files(source, "inferd/"), root)
        env = (("PYTHONPATH", str(release)), ("PYTHONDONTWRITEBYTECODE", "1"))
        # cwd is the release too: ``python -m`` puts the working directory first on sys.path.
        return cls((sys.executable, "-m", "inferd"), release / "inferd", cwd=release, env=env)


@dataclass(frozen=True)
class RestartPolicy:
    initial_delay_s: float = 1.0
    factor: float = 2.0
    max_delay_s: float = 60.0
    max_consecutive_failures: int = 5
    stable_after_s: float = 300.0  # ready this long resets the failure count

    def delay(self, failures: int) -> float:
        return float(min(self.max_delay_s, self.initial_delay_s * self.factor**failures))


class StopMethod(StrEnum):
    NOT_RUNNING = "not_running"
    TERMINATED = "terminated"
    KILLED = "killed"


@dataclass(frozen=True)
class StartReport:
    attempt: int
    pid: int
    startup_s: float
    readiness: Readiness


@dataclass(frozen=True)
class StopReport:
    drained: bool
    incomplete: tuple[str, ...]  # request ids still in flight when the process was stopped
    method: StopMethod
    exit_code: int | None


class Supervisor:
    def __init__(
        self,
        plan: LaunchPlan,
        executable: Executable,
        *,
        log_path: Path,
        startup_timeout_s: float = 300.0,
        probe_interval_s: float = 0.25,
        restart: RestartPolicy | None = None,
        env: Mapping[str, str] | None = None,
        verify_model_bundle: bool = True,
        semantic_probe: bool = True,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.plan = plan
        self.executable = executable
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.probe_interval_s = probe_interval_s
        self.policy = restart or RestartPolicy()
        self._env = dict(os.environ if env is None else env)
        self._verify_bundle = verify_model_bundle
        self.semantic_probe = semantic_probe  # one known request before ready (PROBE_BODY)
        self._sleep = sleep
        self._clock = clock
        self._client = httpx.Client(timeout=httpx.Timeout(5.0), trust_env=False)
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}
        self._admitting = True
        self._attempts = 0
        self._failures = 0
        self._last_launch: float | None = None
        self._ready_at: float | None = None
        self.delays: list[float] = []  # every backoff actually waited, for the record

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        return self._process

    @property
    def command(self) -> tuple[str, ...]:
        return (*self.executable.argv_prefix, *self.plan.launch_args())

    def start(self) -> StartReport:
        """Launch, retrying with backoff, until the exact route is ready."""
        while True:
            try:
                return self._attempt()
            except ArtifactMismatch:
                raise
            except StartupFailed:
                self._failures += 1
                if self._failures >= self.policy.max_consecutive_failures:
                    raise RestartBudgetExhausted(
                        f"{self._failures} consecutive failed starts; see {self.log_path}"
                    ) from None

    def restart(self) -> StartReport:
        """Replace the process (after a crash or on request), honouring the backoff."""
        if (
            self._ready_at is not None
            and self._clock() - self._ready_at >= self.policy.stable_after_s
        ):
            self._failures = 0
        else:
            self._failures += 1
        self._halt(term_timeout_s=10.0)
        return self.start()

    def launch(self) -> subprocess.Popen[bytes]:
        """Verify the pinned artifacts and spawn the process, without waiting for readiness."""
        self._wait_backoff()
        self._verify_artifacts()
        self._attempts += 1
        return self._spawn()

    def _attempt(self) -> StartReport:
        self.launch()
        started = self._clock()
        readiness = self._wait_ready(started + self.startup_timeout_s)
        self._ready_at = self._clock()
        assert self._process is not None
        return StartReport(self._attempts, self._process.pid, self._ready_at - started, readiness)

    def _wait_backoff(self) -> None:
        # The full delay, counted from now rather than from the last launch: a process that
        # ran a while and then died still waits before the next launch.
        if self._last_launch is None:
            return
        delay = self.policy.delay(max(0, self._failures - 1))
        self.delays.append(delay)
        self._sleep(delay)

    def _verify_artifacts(self) -> None:
        actual = artifact_sha256(self.executable.artifact)
        if actual != self.plan.engine.artifact_sha256:
            raise ArtifactMismatch(
                f"{self.executable.artifact} has digest {actual}, "
                f"the plan pins {self.plan.engine.artifact_sha256}"
            )
        if self._verify_bundle:
            verify_bundle(Path(self.plan.model.local_dir), self.plan.model.bundle_sha256)
            if not Path(self.plan.model.entry_path).exists():
                raise ArtifactMismatch(f"{self.plan.model.entry_path} is not in the bundle")

    def _spawn(self) -> subprocess.Popen[bytes]:
        self._close_log()
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self._last_launch = self._clock()
        # An argv list and no shell: the plan's values are never re-parsed as shell text.
        self._process = subprocess.Popen(
            list(self.command),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**self._env, **dict(self.executable.env)},
            cwd=self.executable.cwd,
            start_new_session=True,
        )
        return self._process

    def _wait_ready(self, deadline: float) -> Readiness:
        last = Readiness(ReadinessState.UNREACHABLE, "not probed yet")
        while self._clock() < deadline:
            assert self._process is not None
            code = self._process.poll()
            if code is not None:
                raise StartupFailed(f"the process exited with {code} before it was ready")
            last = self.readiness()
            if last.ready and self.semantic_probe:
                last = probe_answer(self._client, self.plan.base_url, self.plan.model_route)
            if last.ready:
                return last
            self._sleep(self.probe_interval_s)
        self._halt(term_timeout_s=10.0)
        raise StartupFailed(
            f"not ready within {self.startup_timeout_s}s: {last.state} {last.detail}"
        )

    # -- probes ------------------------------------------------------------------------------
    def alive(self) -> bool:
        running = self._process is not None and self._process.poll() is None
        return running and probe_liveness(self._client, self.plan.base_url)

    def readiness(self) -> Readiness:
        return probe_readiness(self._client, self.plan.base_url, self.plan.model_route)

    def watch_once(self) -> StartReport | None:
        """One liveness check: a process that exited or stopped answering /health is
        restarted (with the backoff); the new start's report, or None while it is alive."""
        if self.alive():
            return None
        return self.restart()

    # -- requests ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def track(self, request_id: str) -> Iterator[None]:
        """Count a request as in flight, so that stop() can drain it or report it."""
        with self._lock:
            if not self._admitting:
                raise NotAdmitting("the supervisor is stopping")
            self._in_flight[request_id] = self._in_flight.get(request_id, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight[request_id] -= 1
                if not self._in_flight[request_id]:
                    del self._in_flight[request_id]

    def in_flight(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(sorted(self._in_flight))

    # -- stopping ----------------------------------------------------------------------------
    def kill(self) -> None:
        """SIGKILL now, with no drain: what a crash or an OOM kill looks like to clients."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def stop(self, *, drain_timeout_s: float = 30.0, term_timeout_s: float = 15.0) -> StopReport:
        with self._lock:
            self._admitting = False
        drained = self._drain(drain_timeout_s)
        incomplete = self.in_flight()
        method = self._halt(term_timeout_s)
        code = None if self._process is None else self._process.returncode
        self._client.close()
        self._close_log()
        return StopReport(drained, incomplete, method, code)

    def _drain(self, timeout_s: float) -> bool:
        deadline = self._clock() + timeout_s
        while self.in_flight():
            if self._clock() >= deadline:
                return False
            self._sleep(min(0.05, max(0.0, deadline - self._clock())))
        return True

    def _halt(self, term_timeout_s: float) -> StopMethod:
        proc = self._process
        if proc is None or proc.poll() is not None:
            return StopMethod.NOT_RUNNING
        proc.terminate()
        try:
            proc.wait(term_timeout_s)
            return StopMethod.TERMINATED
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return StopMethod.KILLED

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, n_bytes: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except FileNotFoundError:
            return ""
        return data[-n_bytes:].decode("utf-8", errors="replace")

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop(drain_timeout_s=0.0)
