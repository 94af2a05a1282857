"""No silent skips: a test that skips (or xfails) for a reason not on ``ALLOWED`` fails the run.

A skipped test cannot catch what it names, so ``make test`` passing must mean every test ran,
except those whose reason is a feature the machine may lack. Each skip reason (``pytest.skip``,
``skipif``, ``importorskip``, a module skipped at collection) and each xfail reason (strict or
not: an expected failure hides a failure all the same) is matched against the table below; any
other one is named in a summary at the end and the session exits non-zero.

tests/conftest.py registers ``SkipPolicy`` on the process that reports the session: the only
process without xdist, the controller under ``-n`` (the workers' reports reach it, the test
reports through ``pytest_runtest_logreport`` and a skipped module's through
``pytest_collectreport``). ``-p tests.skip_policy`` loads it alone (tests/test_skip_policy.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pytest

PLUGIN_NAME = "inferd-skip-policy"


@dataclass(frozen=True, slots=True)
class Allowed:
    """A skip reason (``pattern``, searched with ``re.search``) and why it may skip."""

    pattern: str
    why: str


# The allow-list. A reason belongs here only if it is about the machine, never about a missing
# dependency (the test extra pins them: a broken install must fail) or a known bug. The reasons
# come from tests/machine.py, which words them to match.
ALLOWED: tuple[Allowed, ...] = (
    Allowed(
        r"^machine: this CPU lacks AVX-512 VNNI/BF16\b",
        "the int8 (VNNI) kernels and the decode stack are built only for AVX-512 with VNNI and "
        "BF16; an AVX2 machine runs other kernels, which their own tests cover",
    ),
    Allowed(
        r"^machine: INFERD_KERNEL_ISA=\w+ builds the kernels without VNNI\b",
        "a run that forces the AVX2 build on an AVX-512 machine (to test what an AVX2 machine "
        "runs) has no VNNI kernels to test",
    ),
    Allowed(
        r"^machine: not Linux\b",
        "huge-page advice (madvise) and /proc/self/smaps exist only on Linux",
    ),
)


def allowed(reason: str, table: tuple[Allowed, ...] = ALLOWED) -> Allowed | None:
    """The entry that allows ``reason``, if any."""
    return next((entry for entry in table if re.search(entry.pattern, reason)), None)


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str | None:
    """Why ``report`` did not run its test as a plain pass or fail: a skip's or an xfail's
    reason (an xpass included), None for a test that ran."""
    wasxfail = getattr(report, "wasxfail", None)
    if wasxfail is not None:
        return "xfail: " + (str(wasxfail).removeprefix("reason: ") or "(no reason given)")
    if not report.skipped:
        return None
    longrepr = report.longrepr
    # (path, line, message); a list once an xdist worker's report has been sent over
    message = str(longrepr[2]) if isinstance(longrepr, (tuple, list)) else str(longrepr)
    return message.removeprefix("Skipped: ")


@dataclass(eq=False)  # hashable by identity, as pluggy needs a plugin
class SkipPolicy:
    """Collects the reports whose skip reason is not allowed; fails the session if any."""

    table: tuple[Allowed, ...] = ALLOWED
    unlisted: list[tuple[str, str]] = field(default_factory=list)  # (node id, reason)

    def _check(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        reason = skip_reason(report)
        if reason is not None and allowed(reason, self.table) is None:
            self.unlisted.append((report.nodeid, reason))

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._check(report)

    @pytest.hookimpl
    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._check(report)

    @pytest.hookimpl
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        ok = (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
        if self.unlisted and session.exitstatus in ok:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.unlisted:
            return
        terminalreporter.section("skips not on the allow-list (tests/skip_policy.py)", red=True)
        for nodeid, reason in self.unlisted:
            terminalreporter.line(f"{nodeid}: {reason}", red=True)
        terminalreporter.line(
            f"{len(self.unlisted)} test(s) did not run for a reason that is not a machine "
            "feature on tests/skip_policy.py's ALLOWED list: the session fails.",
            red=True,
        )


def register(config: pytest.Config) -> None:
    """Register the policy on the reporting process (not on an xdist worker), once."""
    if hasattr(config, "workerinput") or config.pluginmanager.has_plugin(PLUGIN_NAME):
        return
    config.pluginmanager.register(SkipPolicy(), PLUGIN_NAME)


def pytest_configure(config: pytest.Config) -> None:
    """For ``-p tests.skip_policy`` (tests/conftest.py calls ``register`` itself)."""
    register(config)
