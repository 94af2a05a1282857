"""Promote and roll back (contract/rollout.py): the state a router reads, and what a
promotion needs. The releases served side by side are in test_gate_live.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inferd.contract.bundle import BundleError, publish_bundle
from inferd.contract.gate import GateError
from inferd.contract.plan import LaunchPlan
from inferd.contract.rollout import HISTORY, LIVE, PREVIOUS, promote, read_plan, rollback
from tests.contract.helpers import inferd_plan


def _plan(tmp_path: Path, name: str, port: int) -> LaunchPlan:
    model = tmp_path / f"{name}.gguf"
    model.write_bytes(b"GGUF" + name.encode())
    bundle = publish_bundle({"model.gguf": model}, tmp_path / "bundles")
    return inferd_plan(local_root=str(bundle.parent), bundle=bundle.name, port=port)


def _passed(plan: LaunchPlan) -> dict[str, object]:
    return {"passed": True, "candidate_plan_sha256": plan.identity_sha256(), "rows": []}


def test_promote_then_rollback_swaps_live_and_previous(tmp_path: Path) -> None:
    state = tmp_path / "state"
    one, two = _plan(tmp_path, "one", 9001), _plan(tmp_path, "two", 9002)
    assert promote(state, one, _passed(one)) is None
    assert promote(state, two, _passed(two)) == one
    assert (read_plan(state, LIVE), read_plan(state, PREVIOUS)) == (two, one)
    assert rollback(state) == one
    assert (read_plan(state, LIVE), read_plan(state, PREVIOUS)) == (one, two)
    history = [json.loads(line) for line in (state / HISTORY).read_text().splitlines()]
    assert [h["action"] for h in history] == ["promote", "promote", "rollback"]
    assert history[-1]["live"] == one.identity_sha256()
    assert history[1]["report"] == two.identity_sha256()


def test_a_promotion_needs_a_passing_report_about_this_plan(tmp_path: Path) -> None:
    state = tmp_path / "state"
    one, two = _plan(tmp_path, "one", 9001), _plan(tmp_path, "two", 9002)
    with pytest.raises(GateError, match="did not pass"):
        promote(state, one, {**_passed(one), "passed": False})
    with pytest.raises(GateError, match="another plan"):
        promote(state, one, _passed(two))
    assert not (state / LIVE).exists()
    with pytest.raises(GateError, match="no previous release"):
        rollback(state)


def test_nothing_switches_to_a_release_whose_bundle_changed(tmp_path: Path) -> None:
    state = tmp_path / "state"
    one, two = _plan(tmp_path, "one", 9001), _plan(tmp_path, "two", 9002)
    promote(state, one, _passed(one))
    promote(state, two, _passed(two))
    model = Path(one.model.entry_path)
    model.chmod(0o644)
    model.write_bytes(b"GGUF tampered")
    with pytest.raises(BundleError):
        rollback(state)
    assert read_plan(state, LIVE) == two  # unchanged
