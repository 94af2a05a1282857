"""Which release is live: promote a candidate the gate passed, roll back to the one before.

The state is a directory: ``live.json`` and ``previous.json`` (launch plans, as
``plan_to_dict`` writes them) and ``history.jsonl``, one canonical JSON line per switch naming
both plans' identities and the gate report that allowed it. A router or a fleet tool reads
``live.json``; ``Rollout`` also keeps both releases served, the previous one as a warm standby,
so that a rollback is a switch of roles, not a cold start.

A promotion needs a report that passed and whose candidate is this very plan; the plan it
replaces must still have its bundle intact (else nothing could roll back to it).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from inferd.contract.bundle import verify_bundle
from inferd.contract.canonical import canonical_json
from inferd.contract.gate import GateError
from inferd.contract.plan import LaunchPlan, plan_from_dict, plan_to_dict
from inferd.contract.supervisor import Executable, Supervisor

LIVE, PREVIOUS, HISTORY = "live.json", "previous.json", "history.jsonl"


def read_plan(state: Path, name: str) -> LaunchPlan | None:
    path = state / name
    if not path.exists():
        return None
    return plan_from_dict(json.loads(path.read_text(encoding="utf-8")))


def promote(state: Path, plan: LaunchPlan, report: dict[str, Any]) -> LaunchPlan | None:
    """Make ``plan`` live; the plan it replaces (returned) becomes the previous one."""
    if not report.get("passed"):
        raise GateError("the gate report did not pass: nothing is promoted")
    if report.get("candidate_plan_sha256") != plan.identity_sha256():
        raise GateError("the gate report is about another plan than the one promoted")
    state.mkdir(parents=True, exist_ok=True)
    live = read_plan(state, LIVE)
    if live is not None:
        _still_published(live)
        _write(state / PREVIOUS, live)
    _write(state / LIVE, plan)
    _record(state, "promote", plan, live, report)
    return live


def adopt(state: Path, plan: LaunchPlan) -> None:
    """Name the first live release (the one whose answers were frozen): no gate report
    precedes it, so only a state with no live release takes one this way."""
    if read_plan(state, LIVE) is not None:
        raise GateError(f"{state} already has a live release: promote a candidate instead")
    state.mkdir(parents=True, exist_ok=True)
    _write(state / LIVE, plan)
    _record(state, "adopt", plan, None, None)


def rollback(state: Path) -> LaunchPlan:
    """Swap the live and previous plans; the restored one (returned) is live again."""
    live, previous = read_plan(state, LIVE), read_plan(state, PREVIOUS)
    if live is None or previous is None:
        raise GateError(f"{state}: no previous release to roll back to")
    _still_published(previous)
    _write(state / PREVIOUS, live)
    _write(state / LIVE, previous)
    _record(state, "rollback", previous, live, None)
    return previous


class Rollout:
    """Both releases served: the live one, and the previous one kept ready for a rollback.

    Plans must use different ports. ``promote`` starts the candidate and waits until it is
    ready (the supervisor's semantic probe included) before the state names it live; the
    release two promotions back is then stopped."""

    def __init__(self, state: Path, executable: Executable, log_dir: Path) -> None:
        self.state, self.executable, self.log_dir = state, executable, log_dir
        self.running: dict[str, Supervisor] = {}  # plan identity -> its supervisor

    def start(self) -> None:
        """Serve what the state names (live, and previous as the standby)."""
        for name in (LIVE, PREVIOUS):
            plan = read_plan(self.state, name)
            if plan is not None:
                self._serve(plan)

    def promote(self, plan: LaunchPlan, report: dict[str, Any]) -> None:
        self._serve(plan)
        promote(self.state, plan, report)
        self._stop_all_but(read_plan(self.state, LIVE), read_plan(self.state, PREVIOUS))

    def rollback(self) -> LaunchPlan:
        restored = rollback(self.state)
        self._serve(restored)  # already running unless it died: then restarted now
        return restored

    def stop(self) -> None:
        self._stop_all_but()

    def _serve(self, plan: LaunchPlan) -> None:
        key = plan.identity_sha256()
        supervisor = self.running.get(key)
        if supervisor is not None and supervisor.alive():
            return
        log = self.log_dir / f"{key[:16]}.log"
        if supervisor is None:
            supervisor = Supervisor(plan, self.executable, log_path=log)
            supervisor.start()
        else:  # it died: a restart, with the supervisor's backoff
            supervisor.restart()
        self.running[key] = supervisor

    def _stop_all_but(self, *keep: LaunchPlan | None) -> None:
        kept = {p.identity_sha256() for p in keep if p is not None}
        for key in [k for k in self.running if k not in kept]:
            self.running.pop(key).stop(drain_timeout_s=10.0)


def _still_published(plan: LaunchPlan) -> None:
    verify_bundle(Path(plan.model.local_dir), plan.model.bundle_sha256)


def _write(path: Path, plan: LaunchPlan) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(plan_to_dict(plan), indent=1) + "\n", encoding="utf-8")
    os.replace(partial, path)  # a reader sees the old plan or the new one, never half


def _record(
    state: Path,
    action: str,
    live: LaunchPlan,
    replaced: LaunchPlan | None,
    report: dict[str, Any] | None,
) -> None:
    entry = {
        "action": action,
        "at": round(time.time(), 3),
        "live": live.identity_sha256(),
        "replaced": None if replaced is None else replaced.identity_sha256(),
        "report": None if report is None else report.get("candidate_plan_sha256"),
    }
    with (state / HISTORY).open("ab") as f:
        f.write(canonical_json(entry) + b"\n")
