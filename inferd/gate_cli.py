"""``inferd gate``: the release gate (``contract/gate.py``) from the command line.

    inferd gate plan -m MODEL.gguf --bundles DIR --out plan.json   # pin a release
    inferd gate freeze plan.json --cases cases.json --out GOLDEN   # store its answers
    inferd gate check candidate.json GOLDEN [--report report.json] # exit 1 if it moved
    inferd gate canary live.json candidate.json --cases cases.json   # both served at once
    inferd gate canary live.json candidate.json --cases cases.json --mirror-share 0.1
    inferd gate promote candidate.json --state DIR --report report.json
    inferd gate rollback --state DIR

Plans run this interpreter's ``inferd`` package, whose digest they pin: a plan written for
another installation is refused before anything starts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from inferd.store import DEFAULT_MODEL

if TYPE_CHECKING:
    from inferd.contract.plan import LaunchPlan


def add_gate_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    gate = sub.add_parser(
        "gate", help="release gate: freeze a release's answers and speed, check a candidate"
    )
    steps = gate.add_subparsers(dest="gate_command", required=True, metavar="STEP")

    plan = steps.add_parser("plan", help="publish a GGUF as a bundle and write a launch plan")
    plan.add_argument("-m", "--model", default=DEFAULT_MODEL, help="a .gguf file or store name")
    plan.add_argument("--bundles", type=Path, required=True, help="where bundles are published")
    plan.add_argument("--out", type=Path, required=True, help="the plan file to write (JSON)")
    plan.add_argument("--port", type=int, default=8181)
    plan.add_argument("--dtype", default="auto", choices=["auto", "bf16", "f32"])
    plan.add_argument("--max-seqs", type=int, default=4)
    plan.add_argument("--max-seq-len", type=int, default=2048)
    plan.set_defaults(func=run_gate, step=_plan)

    freeze = steps.add_parser("freeze", help="run a case file on a plan; store the golden")
    freeze.add_argument("plan", type=Path)
    freeze.add_argument("--cases", type=Path, required=True, help="the case file (JSON)")
    freeze.add_argument("--out", type=Path, required=True, help="the golden directory")
    freeze.set_defaults(func=run_gate, step=_freeze)

    check = steps.add_parser("check", help="replay a golden on a candidate plan and compare")
    check.add_argument("plan", type=Path)
    check.add_argument("golden", type=Path)
    check.add_argument("--report", type=Path, default=None, help="also write the report (JSON)")
    check.set_defaults(func=run_gate, step=_check)
    canary = steps.add_parser(
        "canary", help="serve two plans side by side and compare the new one on the cases"
    )
    canary.add_argument("old", type=Path)
    canary.add_argument("new", type=Path)
    canary.add_argument("--cases", type=Path, required=True)
    canary.add_argument("--report", type=Path, default=None, help="also write the report (JSON)")
    canary.add_argument("--logs", type=Path, default=Path("."), help="where the servers log")
    canary.add_argument(
        "--mirror-share",
        type=float,
        default=None,
        metavar="F",
        help="then serve OLD through a loopback proxy that mirrors this share (0 < F <= 1) of "
        "its chat requests to NEW and compares the greedy answers",
    )
    canary.add_argument("--mirror-port", type=int, default=8190, help="the proxy's port")
    canary.add_argument(
        "--mirror-seconds",
        type=float,
        default=600.0,
        help="how long the proxy takes traffic (Ctrl-C ends it sooner)",
    )
    canary.set_defaults(func=run_gate, step=_canary)

    promote = steps.add_parser("promote", help="make a plan that passed the gate the live one")
    promote.add_argument("plan", type=Path)
    promote.add_argument("--state", type=Path, required=True, help="the rollout directory")
    promote.add_argument("--report", type=Path, required=True, help="its passing gate report")
    promote.set_defaults(func=run_gate, step=_promote)

    rollback = steps.add_parser("rollback", help="make the previous plan live again")
    rollback.add_argument("--state", type=Path, required=True)
    rollback.set_defaults(func=run_gate, step=_rollback)
    for sp in (gate, plan, freeze, check, canary, promote, rollback):
        sp.add_argument("--log-level", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def _plan(args: argparse.Namespace) -> int:
    from inferd.contract.bundle import artifact_sha256, file_sha256, publish_bundle
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
    from inferd.source import resolve_source
    from inferd.version import __version__

    path = resolve_source(args.model).path
    if path.is_dir() or path.suffix != ".gguf":
        print("inferd gate plan: -m must be a .gguf file or store name", file=sys.stderr)
        return 2
    bundle = publish_bundle({path.name: path}, args.bundles.resolve())
    plan = LaunchPlan(
        engine=EngineRelease(
            EngineKind.INFERD,
            __version__,
            artifact_sha256(Executable.inferd_module().artifact),  # what freeze and check run
            Device.CPU,
        ),
        model=ModelSource(
            public_id=path.stem,
            revision="sha256:" + file_sha256(path),
            bundle_sha256=bundle.name,
            local_dir=str(bundle),
            format=ModelFormat.GGUF,
            entry=path.name,
        ),
        host="127.0.0.1",
        port=args.port,
        limits=Limits(
            max_seqs=args.max_seqs,
            max_seq_len=args.max_seq_len,
            paged_attention=PagedAttention.ON,
            prefix_cache_n=None,
            max_num_images=0,
            max_image_edge=0,
            device=Device.CPU,
            max_num_batched_tokens=512,
            kv_cache_tokens=args.max_seqs * args.max_seq_len,
            dtype=args.dtype,
            seed=0,
            prefix_caching=Toggle.ON,
        ),
        access_log=AccessLog.JSON,
    )
    args.out.write_text(json.dumps(plan_to_dict(plan), indent=1) + "\n", encoding="utf-8")
    print(f"plan       {args.out}  (bundle {bundle}, identity {plan.identity_sha256()[:16]})")
    return 0


def _freeze(args: argparse.Namespace) -> int:
    from inferd.contract.gate import freeze
    from inferd.contract.supervisor import Executable

    plan = _read_plan(args.plan)
    args.out.mkdir(parents=True, exist_ok=True)
    run = freeze(plan, Executable.inferd_module(), args.cases, args.out, args.out / "serve.log")
    perf = run.performance
    print(
        f"frozen     {len(run.answers)} cases into {args.out}; TTFT p50 {perf.ttft_p50_s}s, "
        f"{perf.throughput_tok_s} tok/s at {perf.concurrency} streams, peak RSS "
        f"{perf.peak_rss_mb} MiB"
    )
    return 0


def _check(args: argparse.Namespace) -> int:
    from inferd.contract.gate import check
    from inferd.contract.supervisor import Executable

    plan = _read_plan(args.plan)
    log = args.golden / "candidate.log"
    report = check(plan, Executable.inferd_module(), args.golden, log)
    print(report.table())
    if args.report is not None:
        args.report.write_text(json.dumps(report.to_json(), indent=1) + "\n", encoding="utf-8")
    return 0 if report.passed else 1


def _canary(args: argparse.Namespace) -> int:
    from inferd.contract.gate import GateError, Mirroring, canary
    from inferd.contract.supervisor import Executable

    old, new = _read_plan(args.old), _read_plan(args.new)
    mirroring = None
    if args.mirror_share is not None:
        if not 0 < args.mirror_share <= 1:
            raise GateError(f"--mirror-share must be in (0, 1], got {args.mirror_share}")
        traffic = _wait_for_traffic(args.mirror_seconds)
        mirroring = Mirroring(args.mirror_share, traffic, args.mirror_port)
    report = canary(old, new, Executable.inferd_module(), args.cases, args.logs, mirroring)
    print(report.table())
    if args.report is not None:
        args.report.write_text(json.dumps(report.to_json(), indent=1) + "\n", encoding="utf-8")
    return 0 if report.passed else 1


def _wait_for_traffic(seconds: float) -> Callable[[str], None]:
    def wait(url: str) -> None:
        print(f"mirroring  send traffic to {url} for {seconds:g}s (Ctrl-C ends it)", flush=True)
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: report what was mirrored
            time.sleep(seconds)

    return wait


def _promote(args: argparse.Namespace) -> int:
    from inferd.contract.rollout import promote

    plan = _read_plan(args.plan)
    replaced = promote(args.state, plan, json.loads(args.report.read_text(encoding="utf-8")))
    was = f"; previous {replaced.identity_sha256()[:16]}" if replaced is not None else ""
    print(f"live       {plan.identity_sha256()[:16]}  ({plan.model_route}){was}")
    return 0


def _rollback(args: argparse.Namespace) -> int:
    from inferd.contract.rollout import rollback

    plan = rollback(args.state)
    print(f"live       {plan.identity_sha256()[:16]}  ({plan.model_route}), rolled back")
    return 0


def _read_plan(path: Path) -> LaunchPlan:
    from inferd.contract.plan import plan_from_dict

    return plan_from_dict(json.loads(path.read_text(encoding="utf-8")))


def run_gate(args: argparse.Namespace) -> int:
    """The chosen step; a plan, case file or golden the gate cannot use ends with its reason."""
    from inferd.contract.gate import GateError
    from inferd.contract.plan import PlanError
    from inferd.contract.supervisor import SupervisorError

    try:
        with _sigterm_as_interrupt():
            return int(args.step(args))
    except (GateError, PlanError, SupervisorError, OSError, json.JSONDecodeError) as exc:
        print(f"inferd gate {args.gate_command}: {exc}", file=sys.stderr)
        return 2


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM ends a step as Ctrl-C does, so the servers it started are stopped on the way
    out: its default action would end the gate at once and leave them running (each in a
    session of its own). Outside the main thread no handler can be set, and none is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
