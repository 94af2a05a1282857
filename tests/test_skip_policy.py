"""The skip policy (tests/skip_policy.py) on real pytest runs of tiny generated test files: a skip
or xfail whose reason is not on the allow-list fails the session and is named; a listed one
does not; the same under xdist, where the workers' reports reach the controller. And every
reason tests/machine.py gives for a missing machine feature is on the list."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from inferd import kernels
from tests import machine
from tests.skip_policy import ALLOWED, allowed

ROOT = Path(__file__).resolve().parent.parent
LISTED = "machine: not Linux: for the test"  # matches an ALLOWED pattern
HEADING = "skips not on the allow-list"


def _run(tmp_path: Path, files: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """pytest with only the policy plugin (``-p tests.skip_policy``) on ``files`` in a fresh
    directory of their own (its empty pytest.ini keeps the repository's settings out)."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    for name, text in files.items():
        (tmp_path / name).write_text("import pytest\n\n" + text)
    env = os.environ | {"PYTHONPATH": str(ROOT), "PYTEST_ADDOPTS": ""}
    env.pop("PYTEST_XDIST_WORKER", None)  # this run may itself be on an xdist worker
    env.pop("PYTEST_XDIST_WORKER_COUNT", None)
    command = [sys.executable, "-m", "pytest", "-p", "tests.skip_policy", "-p", "no:cacheprovider"]
    return subprocess.run(
        [*command, "-q", *args, str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ("def test_a():\n    pytest.skip('the network is down')\n", "the network is down"),
        (
            "@pytest.mark.skipif(True, reason='no time today')\ndef test_a():\n    pass\n",
            "no time today",
        ),
        (
            "def test_a():\n    pytest.importorskip('no_such_module_anywhere')\n",
            "could not import 'no_such_module_anywhere'",
        ),
        (
            "pytest.skip('whole module', allow_module_level=True)\ndef test_a():\n    pass\n",
            "whole module",
        ),
        (
            "@pytest.mark.xfail(reason='known bug')\ndef test_a():\n    assert False\n",
            "xfail: known bug",
        ),
        (  # an xpass of a non-strict xfail: the run passes, and the mark hid nothing yet
            "@pytest.mark.xfail(reason='maybe broken')\ndef test_a():\n    pass\n",
            "xfail: maybe broken",
        ),
    ],
    ids=["skip", "skipif", "importorskip", "module", "xfail", "xpass"],
)
def test_an_unlisted_skip_fails_the_run_and_is_named(tmp_path: Path, body: str, named: str) -> None:
    files = {"test_one.py": body + "\ndef test_b():\n    pass\n"}
    result = _run(tmp_path, files)
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, result.stdout + result.stderr
    summary = result.stdout.split(HEADING, 1)[1]
    assert "test_one.py" in summary and named in summary


def test_a_listed_skip_passes(tmp_path: Path) -> None:
    body = (
        f"def test_a():\n    pytest.skip({LISTED!r})\n\n"
        f"@pytest.mark.skipif(True, reason={LISTED!r})\ndef test_b():\n    pass\n\n"
        "def test_c():\n    pass\n"
    )
    result = _run(tmp_path, {"test_one.py": body})
    assert result.returncode == pytest.ExitCode.OK, result.stdout + result.stderr
    assert "2 skipped" in result.stdout and HEADING not in result.stdout


def test_a_failure_keeps_its_exit_status(tmp_path: Path) -> None:
    body = "def test_a():\n    assert False\n\ndef test_b():\n    pytest.skip('unlisted')\n"
    result = _run(tmp_path, {"test_one.py": body})
    assert result.returncode == pytest.ExitCode.TESTS_FAILED
    assert "unlisted" in result.stdout.split(HEADING, 1)[1]


def test_under_xdist_the_controller_sees_the_workers_skips(tmp_path: Path) -> None:
    """As ``make test`` runs (``-n 2 --dist loadfile``): a skipped module and a skipped test on
    the workers are both named by the controller, a listed skip is not."""
    files = {
        "test_one.py": "pytest.skip('module gone', allow_module_level=True)\n",
        "test_two.py": "def test_a():\n    pytest.skip('test gone')\n",
        "test_three.py": f"def test_a():\n    pytest.skip({LISTED!r})\n",
    }
    result = _run(tmp_path, files, "-n", "2", "--dist", "loadfile")
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, result.stdout + result.stderr
    summary = result.stdout.split(HEADING, 1)[1]
    assert "module gone" in summary and "test gone" in summary
    assert "test_three.py" not in summary
    del files["test_one.py"], files["test_two.py"]
    for name in ("test_one.py", "test_two.py"):
        (tmp_path / name).unlink()
    listed_only = _run(tmp_path, files, "-n", "2", "--dist", "loadfile")
    assert listed_only.returncode == pytest.ExitCode.OK, listed_only.stdout + listed_only.stderr


def test_the_machine_reasons_are_on_the_list(monkeypatch: pytest.MonkeyPatch) -> None:
    assert allowed(machine.NOT_LINUX_REASON) is not None
    monkeypatch.delenv(kernels.ISA_ENV, raising=False)
    monkeypatch.delenv(kernels.INT4_INT8_ENV, raising=False)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    no_cpu = machine.vnni_missing()
    assert no_cpu is not None and "avx512_vnni" in no_cpu and allowed(no_cpu) is not None
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset(kernels.ISAS[0].needs))
    assert machine.vnni_missing() is None
    monkeypatch.setenv(kernels.ISA_ENV, "avx2")
    forced = machine.vnni_missing()
    assert forced is not None and allowed(forced) is not None
    # Turned off by the environment: not the machine, so not allowed (the run fails, naming it).
    monkeypatch.delenv(kernels.ISA_ENV)
    monkeypatch.setenv(kernels.INT4_INT8_ENV, "0")
    off = machine.vnni_missing()
    assert off is not None and allowed(off) is None


def test_the_list_allows_no_dependency_or_bug() -> None:
    """The reasons a pinned dependency or a known bug would give are not machine features."""
    for reason in ("could not import 'transformers': No module named 'transformers'", "xfail: "):
        assert allowed(reason) is None
    assert all(entry.pattern.startswith("^machine: ") and entry.why for entry in ALLOWED)
