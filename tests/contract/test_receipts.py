"""Receipts: canonical bytes, a digest that moves with every bound field, write-once files."""

from __future__ import annotations

import dataclasses
import json
import stat
from pathlib import Path
from typing import Any

import pytest

from inferd.contract.canonical import canonical_json, sha256_hex
from inferd.contract.example import build_report, example_plan
from inferd.contract.receipts import (
    LaunchReceipt,
    ReceiptError,
    RequestReceipt,
    StreamReceipt,
    launch_receipt,
    read_receipt,
    write_receipt,
)
from inferd.contract.stream import Usage


def _receipts(tmp_path: Path) -> list[Any]:
    report = build_report(tmp_path / "staging")["receipts"]
    out: list[Any] = []
    for cls, name in (
        (LaunchReceipt, "launch"),
        (RequestReceipt, "request"),
        (StreamReceipt, "stream"),
    ):
        fields = {k: v for k, v in report[name].items() if k not in ("kind", "sha256")}
        if name == "stream":
            fields["usage"] = Usage(**fields["usage"])
        for key, value in fields.items():
            if isinstance(value, list):
                fields[key] = tuple(value)
        receipt = cls(**fields)
        assert receipt.sha256 == report[name]["sha256"]
        out.append(receipt)
    return out


def _other(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, tuple):
        return (*value[1:], value[0]) if len(set(value)) > 1 else (*value, "extra")
    if isinstance(value, Usage):
        return Usage(value.prompt_tokens, value.completion_tokens - 1, value.total_tokens - 1)
    if value is None:
        return "set"
    raise AssertionError(type(value))


def test_receipts_are_canonical_json(tmp_path: Path) -> None:
    for receipt in _receipts(tmp_path):
        data = receipt.canonical()
        assert data == canonical_json(json.loads(data))
        assert receipt.sha256 == sha256_hex(data)


def test_changing_any_bound_field_changes_the_digest(tmp_path: Path) -> None:
    for receipt in _receipts(tmp_path):
        for f in dataclasses.fields(receipt):
            changed = dataclasses.replace(receipt, **{f.name: _other(getattr(receipt, f.name))})
            assert changed.sha256 != receipt.sha256, (receipt.KIND, f.name)


def test_reordering_artifacts_changes_the_request_receipt(tmp_path: Path) -> None:
    request = _receipts(tmp_path)[1]
    swapped = dataclasses.replace(
        request, artifact_digests=tuple(reversed(request.artifact_digests))
    )
    assert swapped.sha256 != request.sha256


def test_serving_identity_binds_the_whole_plan() -> None:
    plan = example_plan()
    wider = dataclasses.replace(plan, limits=dataclasses.replace(plan.limits, prefix_cache_n=0))
    assert launch_receipt(wider).sha256 != launch_receipt(plan).sha256


def test_write_once_read_only_and_verified(tmp_path: Path) -> None:
    receipt = _receipts(tmp_path)[2]
    path = write_receipt(tmp_path / "receipts", receipt)
    assert path.name == f"stream-{receipt.sha256}.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o444
    assert write_receipt(tmp_path / "receipts", receipt) == path
    assert read_receipt(path)["wire_sha256"] == receipt.wire_sha256
    path.chmod(0o644)
    path.write_bytes(path.read_bytes().replace(b'"complete"', b'"cancelled"'))
    with pytest.raises(ReceiptError, match="digest"):
        read_receipt(path)
