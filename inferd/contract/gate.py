"""The release gate: freeze what a release answers and how fast, then check a candidate.

``freeze`` launches a plan under the ``Supervisor``, checks the running server's facts
(``/v1/system/info``: what ``inferd doctor`` says, and the kernels the model really runs)
against what the plan requires, runs every case of a case file greedily and measures the
performance; it writes ``GOLDEN_DIR/golden.json``: the plan, the model's identity per part
(``identity.py``), the environment, each case's answer with its evidence digests, and the
performance baseline. ``check`` does the same against a candidate plan and compares:

- each case: the HTTP status; for a refusal case (adversarial input), that it is refused
  again with the same error code; else the finish reason, the prompt's token count, usage
  arithmetic (total = prompt + completion), the exact text and tool calls (greedy answers
  do not move on an unchanged release), the largest log-prob distance over the golden's
  top-k tokens up to the first token that differs, and a ``json_schema`` answer's validity;
- performance: cold load, TTFT and inter-token latency p50/p99, throughput at the plan's
  concurrency, TTFT p99 at twice it (queueing under overload) and peak RSS, each against
  the baseline with the declared tolerance;
- identity: which parts changed (reported; the cases decide whether the change matters);
- environment: a different kernel ISA, dtype or kernel set makes the figures incomparable,
  so it fails.

``canary`` serves two plans at once and compares them the same way, then, given a
``Mirroring``, on a share of real traffic sent through a proxy in front of the old one
(``mirror.py``): the caller gets the old release's answers, and each mirrored greedy request
whose candidate answer differs fails its row.

A case file is JSON: ``{"tolerances": {...}, "cases": [{"id", "body", "refusal"?}]}``; a body
is a chat completions body without ``model`` and ``stream`` (the gate sets the plan's route,
temperature 0, the plan's seed and top-k log-probs).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import itertools
import json
import re
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from inferd.contract.canonical import digest_of
from inferd.contract.identity import changed_parts, model_identity, served_model_path
from inferd.contract.mirror import MirrorProxy, MirrorStats
from inferd.contract.plan import LaunchPlan, ModelFormat, plan_to_dict
from inferd.contract.supervisor import Executable, Supervisor

SCHEMA = "inferd.gate/1"
TOP_K = 5
PERF_PROMPT = "Count from one to fifty, in words, separated by commas."
# What stands before the timed prompt when the case file asks for a longer context.
PERF_CONTEXT = "The keeper's log: the sea was calm at dawn, the lamp was lit at dusk."
_DATA_URL = re.compile(r"^data:[^;,]+;base64,(.*)$", re.DOTALL)


class GateError(ValueError):
    """A case file, a golden directory or a server that the gate cannot use; says which."""


@dataclass(frozen=True)
class Tolerances:
    exact_text: bool = True  # greedy text and tool calls must not move
    logprob_distance: float = 0.05  # nats, over the golden's top-k tokens at each position
    latency_growth: float = 0.5  # TTFT, inter-token latency and cold load may grow by 50%
    throughput_drop: float = 0.33  # tokens/s may fall by a third
    rss_growth: float = 0.25
    perf_samples: int = 5  # sequential streams for TTFT / inter-token latency
    perf_tokens: int = 16  # tokens each timed stream generates
    # words of context before the timed prompt (0: the prompt alone): the figures at a longer
    # context, where each token's attention, and a release that recomputes it, costs more
    perf_context_words: int = 0


@dataclass(frozen=True)
class Case:
    id: str
    body: dict[str, Any]
    refusal: bool = False  # adversarial: the release must refuse it with a 4xx


@dataclass
class Answer:
    id: str
    status: int
    request_sha256: str
    evidence: list[str] = field(default_factory=list)  # sha256 of each inline media payload
    error_code: str | None = None
    finish_reason: str | None = None
    text: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, int] = field(default_factory=dict)
    # per generated token: its text, its log-prob and the top-k alternatives'
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    schema_valid: bool | None = None  # a json_schema answer: does it validate


@dataclass(frozen=True)
class Performance:
    cold_load_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    throughput_tok_s: float
    concurrency: int
    overload_ttft_p99_s: float
    peak_rss_mb: float


@dataclass(frozen=True)
class Row:
    kind: str  # case | performance | identity | environment
    name: str
    passed: bool
    detail: str


@dataclass
class Report:
    rows: list[Row]
    golden_plan_sha256: str = ""
    candidate_plan_sha256: str = ""

    @property
    def passed(self) -> bool:
        return all(row.passed for row in self.rows)

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "golden_plan_sha256": self.golden_plan_sha256,
            "candidate_plan_sha256": self.candidate_plan_sha256,
            "rows": [asdict(r) for r in self.rows],
        }

    def table(self) -> str:
        width = max((len(r.name) for r in self.rows), default=4)
        lines = [f"{'kind':<12} {'name':<{width}}  result  detail"]
        for r in self.rows:
            verdict = "ok" if r.passed else "FAIL"
            lines.append(f"{r.kind:<12} {r.name:<{width}}  {verdict:<6}  {r.detail}")
        failed = sum(not r.passed for r in self.rows)
        verdict = "PASSED" if self.passed else "FAILED"
        lines.append(f"gate {verdict}: {failed} of {len(self.rows)} rows failed")
        return "\n".join(lines)


def load_cases(path: Path) -> tuple[list[Case], Tolerances]:
    """The case file's cases and tolerances; GateError naming what is wrong."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        tolerances = Tolerances(**data.get("tolerances", {}))
        cases = [
            Case(str(c["id"]), dict(c["body"]), bool(c.get("refusal", False)))
            for c in data["cases"]
        ]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise GateError(f"{path}: not a case file ({type(exc).__name__}: {exc})") from None
    ids = [c.id for c in cases]
    if not cases or len(set(ids)) != len(ids):
        raise GateError(f"{path}: cases need unique ids, and at least one case")
    for case in cases:
        if {"model", "stream"} & case.body.keys():
            raise GateError(f"case {case.id}: the gate sets model and stream; leave them out")
    return cases, tolerances


# -- running a release --------------------------------------------------------------------


@dataclass
class Run:
    """One release measured: what ``golden.json`` holds (and what a check compares)."""

    plan: dict[str, Any]
    plan_sha256: str
    identity: dict[str, str | None]
    environment: dict[str, Any]
    answers: list[Answer]
    performance: Performance
    tolerances: Tolerances

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "plan": self.plan,
            "plan_sha256": self.plan_sha256,
            "identity": self.identity,
            "environment": self.environment,
            "answers": [asdict(a) for a in self.answers],
            "performance": asdict(self.performance),
            "tolerances": asdict(self.tolerances),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Run:
        if data.get("schema") != SCHEMA:
            raise GateError(f"not a {SCHEMA} golden (schema {data.get('schema')!r})")
        return cls(
            plan=data["plan"],
            plan_sha256=data["plan_sha256"],
            identity=data["identity"],
            environment=data["environment"],
            answers=[Answer(**a) for a in data["answers"]],
            performance=Performance(**data["performance"]),
            tolerances=Tolerances(**data["tolerances"]),
        )


@contextlib.contextmanager
def serving(plan: LaunchPlan, executable: Executable, log_path: Path) -> Iterator[Release]:
    """``plan`` started under the supervisor (ready, semantic probe included) until exit."""
    if executable.cwd is None and plan.model.format is ModelFormat.CONFIG:
        # in its bundle: a config's model paths are relative to it
        executable = replace(executable, cwd=Path(plan.model.local_dir))
    supervisor = Supervisor(plan, executable, log_path=log_path)
    with supervisor, httpx.Client(trust_env=False, timeout=300) as client:
        started = supervisor.start()
        assert supervisor.process is not None
        yield Release(plan, client, started.startup_s, supervisor.process.pid)


@dataclass(frozen=True)
class Release:
    """A release being served: its plan, a client, its cold load time and its process."""

    plan: LaunchPlan
    client: httpx.Client
    cold_load_s: float
    pid: int

    def run(self, cases: list[Case], tolerances: Tolerances) -> Run:
        """Check its environment, run the cases, measure."""
        plan = self.plan
        environment = server_environment(self.client, plan)
        answers = [run_case(self.client, plan, case) for case in cases]
        performance = measure(self.client, plan, tolerances, self.cold_load_s, self.pid)
        try:
            identity = model_identity(served_model_path(plan))
        except ValueError as exc:
            raise GateError(str(exc)) from None
        return Run(
            plan_to_dict(plan),
            plan.identity_sha256(),
            identity,
            environment,
            answers,
            performance,
            tolerances,
        )


def run_release(
    plan: LaunchPlan,
    executable: Executable,
    cases: list[Case],
    tolerances: Tolerances,
    log_path: Path,
) -> Run:
    """Launch ``plan``, check its environment, run the cases, measure; then stop it."""
    with serving(plan, executable, log_path) as release:
        return release.run(cases, tolerances)


@dataclass(frozen=True)
class Mirroring:
    """A canary's share of mirrored traffic (``mirror.py``): a proxy on ``port`` (0: any free
    one) in front of the old release; ``traffic(proxy_url)`` returns once the traffic to mirror
    has been sent (the CLI waits a while; a test sends its requests)."""

    share: float
    traffic: Callable[[str], None]
    port: int = 0


def canary(
    old: LaunchPlan,
    new: LaunchPlan,
    executable: Executable,
    cases_path: Path,
    log_dir: Path,
    mirroring: Mirroring | None = None,
) -> Report:
    """Serve both plans side by side (the same machine, at the same time) and compare the
    new one against the old on the same cases and measurements, then on the mirrored share of
    the traffic ``mirroring`` sends through its proxy (one row per mirrored request)."""
    if (old.host, old.port) == (new.host, new.port):
        raise GateError("a canary serves both plans at once: give them different ports")
    cases, tolerances = load_cases(cases_path)
    with (
        serving(old, executable, log_dir / "old.log") as live,
        serving(new, executable, log_dir / "new.log") as candidate,
    ):
        report = compare(live.run(cases, tolerances), candidate.run(cases, tolerances))
        if mirroring is not None:
            with MirrorProxy(
                old.base_url, new.base_url, new.model_route, mirroring.share, port=mirroring.port
            ) as proxy:
                mirroring.traffic(proxy.url)
            report.rows += mirror_rows(proxy.stats, mirroring.share)
    return report


def mirror_rows(stats: MirrorStats, share: float) -> list[Row]:
    """One row per mirrored request (failed where the greedy answers diverged), then the
    share's summary."""
    rows = []
    for record in stats.records:
        if not record.compared:
            detail = "sampled: sent, not compared"
        else:
            detail = "; ".join(record.divergences) or "same answer"
        rows.append(Row("mirror", record.request_id, not record.divergences, detail))
    diverged = sum(bool(r.divergences) for r in stats.records)
    compared = sum(r.compared for r in stats.records)
    summary = (
        f"{len(stats.records)} of {stats.chat_requests} chat requests mirrored (share "
        f"{share:g}); {compared} compared, {diverged} diverged, {stats.dropped} dropped"
    )
    return [*rows, Row("mirror", "mirrored share", True, summary)]


def freeze(
    plan: LaunchPlan, executable: Executable, cases_path: Path, out: Path, log_path: Path
) -> Run:
    """Run ``plan`` on the case file and store it as the golden release in ``out``."""
    cases, tolerances = load_cases(cases_path)
    run = run_release(plan, executable, cases, tolerances, log_path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "golden.json").write_text(json.dumps(run.to_json(), indent=1, ensure_ascii=False))
    (out / "cases.json").write_text(cases_path.read_text(encoding="utf-8"))
    return run


def check(plan: LaunchPlan, executable: Executable, golden_dir: Path, log_path: Path) -> Report:
    """Run the candidate ``plan`` on the golden's cases and compare (see the module doc)."""
    try:
        golden = Run.from_json(json.loads((golden_dir / "golden.json").read_text("utf-8")))
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise GateError(f"{golden_dir}: no readable golden.json ({exc})") from None
    cases, _ = load_cases(golden_dir / "cases.json")
    candidate = run_release(plan, executable, cases, golden.tolerances, log_path)
    return compare(golden, candidate)


def server_environment(client: httpx.Client, plan: LaunchPlan) -> dict[str, Any]:
    """The facts the figures depend on, from the running server; GateError where the machine
    cannot give what the plan requires (a bf16 plan on a CPU without native bf16)."""
    info = client.get(plan.base_url + "/v1/system/info").raise_for_status().json()
    choices, model = info.get("choices", {}), None
    for entry in info.get("server", {}).get("models", []):
        if entry.get("id") == plan.model_route:
            model = entry
    if model is None:
        raise GateError(f"the server does not report model {plan.model_route}")
    if plan.limits.dtype == "bf16" and not choices.get("native_bf16"):
        raise GateError("the plan computes in bf16, and this CPU has no native bf16 (doctor)")
    features = info.get("cpu", {}).get("features", {})
    return {
        "kernel_isa": choices.get("kernel_isa"),
        "cpu_features": {k: features[k] for k in sorted(features)},
        "dtype": model.get("dtype"),
        "kernels": model.get("kernels"),
        "inferd": info.get("inferd"),
        "torch": info.get("torch", {}).get("version"),
    }


def run_case(client: httpx.Client, plan: LaunchPlan, case: Case) -> Answer:
    body = {**case.body, "model": plan.model_route, "stream": False}
    if not case.refusal:  # an adversarial body goes as written
        body["temperature"] = 0
        body.setdefault("logprobs", True)
        body.setdefault("top_logprobs", TOP_K)
        if plan.limits.seed is not None:
            body.setdefault("seed", plan.limits.seed)
    response = client.post(plan.base_url + "/v1/chat/completions", json=body)
    # The request as frozen: the route aside (a candidate may serve the model under another id).
    frozen = {k: v for k, v in body.items() if k != "model"}
    answer = Answer(case.id, response.status_code, digest_of(frozen), _evidence(body))
    payload = (
        response.json()
        if response.headers.get("content-type", "").startswith("application/json")
        else {}
    )
    if response.status_code != 200:
        answer.error_code = (payload.get("error") or {}).get("code") or (
            payload.get("error") or {}
        ).get("type")
        return answer
    choice = payload["choices"][0]
    message = choice["message"]
    answer.finish_reason = choice["finish_reason"]
    answer.text = message.get("content")
    answer.tool_calls = [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in message.get("tool_calls") or []
    ]
    answer.usage = {
        k: payload["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    }
    answer.logprobs = [
        {
            "token": t["token"],
            "logprob": t["logprob"],
            "top": {alt["token"]: alt["logprob"] for alt in t.get("top_logprobs", [])},
        }
        for t in ((choice.get("logprobs") or {}).get("content") or [])
    ]
    schema = ((body.get("response_format") or {}).get("json_schema") or {}).get("schema")
    if schema is not None:
        answer.schema_valid = _valid(answer.text, schema)
    return answer


def _evidence(body: dict[str, Any]) -> list[str]:
    """The sha256 of every inline (data: URL) media payload in the request, in order."""
    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)
        elif isinstance(value, str) and (m := _DATA_URL.match(value)):
            found.append(hashlib.sha256(base64.b64decode(m.group(1))).hexdigest())

    walk(body.get("messages"))
    return found


def _valid(text: str | None, schema: dict[str, Any]) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text or ""), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


# -- performance --------------------------------------------------------------------------


def measure(
    client: httpx.Client, plan: LaunchPlan, tolerances: Tolerances, cold_load_s: float, pid: int
) -> Performance:
    ttfts, gaps = [], []
    for _ in range(tolerances.perf_samples):
        ttft, stream_gaps, _ = _timed_stream(client, plan, tolerances)
        ttfts.append(ttft)
        gaps += stream_gaps
    concurrency = plan.limits.max_seqs
    started = time.monotonic()
    results = _concurrent(client, plan, concurrency, tolerances)
    throughput = sum(r[2] for r in results) / (time.monotonic() - started)
    overload = _concurrent(client, plan, 2 * concurrency, tolerances)
    return Performance(
        cold_load_s=round(cold_load_s, 3),
        ttft_p50_s=_quantile(ttfts, 0.5),
        ttft_p99_s=_quantile(ttfts, 0.99),
        itl_p50_s=_quantile(gaps, 0.5),
        itl_p99_s=_quantile(gaps, 0.99),
        throughput_tok_s=round(throughput, 2),
        concurrency=concurrency,
        overload_ttft_p99_s=_quantile([r[0] for r in overload], 0.99),
        peak_rss_mb=_peak_rss_mb(pid),
    )


def perf_prompt(context_words: int) -> str:
    """The timed prompt, after ``context_words`` words of ``PERF_CONTEXT`` said over and over."""
    words = PERF_CONTEXT.split()
    context = [words[i % len(words)] for i in range(context_words)]
    return " ".join(context) + "\n\n" + PERF_PROMPT if context else PERF_PROMPT


def _timed_stream(
    client: httpx.Client, plan: LaunchPlan, tolerances: Tolerances
) -> tuple[float, list[float], int]:
    """(TTFT, gaps between content chunks, completion tokens) of one streamed request."""
    prompt = perf_prompt(tolerances.perf_context_words)
    body = {
        "model": plan.model_route,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tolerances.perf_tokens,
        "temperature": 0,
        "ignore_eos": True,  # every sample the same length
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent, arrivals, completion = time.monotonic(), [], 0
    with client.stream("POST", plan.base_url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise GateError(f"a timed request was refused: HTTP {response.status_code}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("usage"):
                completion = chunk["usage"]["completion_tokens"]
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                arrivals.append(time.monotonic())
    if not arrivals:
        raise GateError("a timed request streamed no content")
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return arrivals[0] - sent, gaps, completion


def _concurrent(
    client: httpx.Client, plan: LaunchPlan, streams: int, tolerances: Tolerances
) -> list[tuple[float, list[float], int]]:
    results: list[tuple[float, list[float], int]] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            results.append(_timed_stream(client, plan, tolerances))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _quantile(values: list[float], q: float) -> float:
    if len(values) < 2:
        return round(values[0], 4) if values else 0.0
    return round(statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1], 4)


def _peak_rss_mb(pid: int) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


# -- comparing ----------------------------------------------------------------------------


def compare(golden: Run, candidate: Run) -> Report:
    tol = golden.tolerances
    rows = _environment_rows(golden.environment, candidate.environment)
    moved = changed_parts(golden.identity, candidate.identity)
    for part in golden.identity:
        detail = "changed" if part in moved else "same"
        rows.append(Row("identity", part, True, detail))
    by_id = {a.id: a for a in candidate.answers}
    for old in golden.answers:
        new = by_id.get(old.id)
        problems = ["not run"] if new is None else compare_answer(old, new, tol)
        rows.append(
            Row("case", old.id, not problems, "; ".join(problems) or _case_detail(old, new))
        )
    rows += _performance_rows(golden.performance, candidate.performance, tol)
    return Report(rows, golden.plan_sha256, candidate.plan_sha256)


def compare_answer(old: Answer, new: Answer, tol: Tolerances) -> list[str]:
    """What moved between two answers to one case, beyond the tolerances ([]: nothing)."""
    if old.request_sha256 != new.request_sha256 or old.evidence != new.evidence:
        return ["the request or its evidence differs from the frozen one"]
    if old.status != 200:  # a refusal case: refused again, the same way
        if new.status == old.status and new.error_code == old.error_code:
            return []
        return [
            f"refusal moved: HTTP {old.status} {old.error_code} -> {new.status} {new.error_code}"
        ]
    if new.status != 200:
        return [f"HTTP 200 -> {new.status} {new.error_code}"]
    problems = []
    if new.finish_reason != old.finish_reason:
        problems.append(f"finish_reason {old.finish_reason} -> {new.finish_reason}")
    if new.usage.get("prompt_tokens") != old.usage.get("prompt_tokens"):
        problems.append(
            f"prompt_tokens {old.usage.get('prompt_tokens')} -> {new.usage.get('prompt_tokens')}"
        )
    u = new.usage
    if u.get("total_tokens") != u.get("prompt_tokens", 0) + u.get("completion_tokens", 0):
        problems.append(f"usage does not add up: {u}")
    if tol.exact_text and (new.text != old.text or new.tool_calls != old.tool_calls):
        problems.append(f"text moved at token {_first_divergence(old, new)}")
    distance = logprob_distance(old, new)
    if distance > tol.logprob_distance:
        problems.append(f"log-prob distance {distance:.4f} > {tol.logprob_distance}")
    if old.schema_valid and not new.schema_valid:  # a regression; invalid before stays a fact
        problems.append("the answer no longer matches its json_schema")
    return problems


def logprob_distance(old: Answer, new: Answer) -> float:
    """The largest |log-prob change| of the golden's top-k tokens, over the positions before
    the first token that differs (after it the two prefixes are different inputs)."""
    worst = 0.0
    for position in range(_first_divergence(old, new) + 1):
        if position >= min(len(old.logprobs), len(new.logprobs)):
            break
        before, after = old.logprobs[position]["top"], new.logprobs[position]["top"]
        for token in before.keys() & after.keys():
            worst = max(worst, abs(before[token] - after[token]))
    return round(worst, 6)


def _first_divergence(old: Answer, new: Answer) -> int:
    for i, (a, b) in enumerate(zip(old.logprobs, new.logprobs, strict=False)):
        if a["token"] != b["token"]:
            return i
    return min(len(old.logprobs), len(new.logprobs))


def _case_detail(old: Answer, new: Answer | None) -> str:
    if old.status != 200:
        return f"refused again (HTTP {old.status} {old.error_code})"
    assert new is not None
    return f"same answer; log-prob distance {logprob_distance(old, new):.4f}"


def _plain_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _environment_rows(old: dict[str, Any], new: dict[str, Any]) -> list[Row]:
    rows = []
    for key in ("kernel_isa", "dtype", "kernels"):
        same = old.get(key) == new.get(key)
        detail = "same" if same else f"{_plain_json(old.get(key))} -> {_plain_json(new.get(key))}"
        rows.append(Row("environment", key, same, detail))
    return rows


# metric: (higher is worse, tolerance attribute)
_METRICS = {
    "cold_load_s": (True, "latency_growth"),
    "ttft_p50_s": (True, "latency_growth"),
    "ttft_p99_s": (True, "latency_growth"),
    "itl_p50_s": (True, "latency_growth"),
    "itl_p99_s": (True, "latency_growth"),
    "overload_ttft_p99_s": (True, "latency_growth"),
    "throughput_tok_s": (False, "throughput_drop"),
    "peak_rss_mb": (True, "rss_growth"),
}


def _performance_rows(old: Performance, new: Performance, tol: Tolerances) -> list[Row]:
    rows = []
    for name, (worse_up, attr) in _METRICS.items():
        base, value, limit = getattr(old, name), getattr(new, name), getattr(tol, attr)
        if not base:
            # Nothing measured at freeze (inter-token gaps of streams whose tokens all came in
            # one chunk): no baseline to bound against, so the row says so rather than failing
            # every candidate that did measure one.
            rows.append(Row("performance", name, True, f"no baseline -> {value:g}"))
            continue
        bound = base * (1 + limit) if worse_up else base * (1 - limit)
        ok = value <= bound if worse_up else value >= bound
        ratio = value / base
        rows.append(
            Row("performance", name, ok, f"{base:g} -> {value:g} ({ratio:.2f}x; bound {bound:.4g})")
        )
    return rows
