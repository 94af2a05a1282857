"""The approval broker of the agent loop: answered, denied, timed out, withdrawn."""

from __future__ import annotations

import asyncio

import pytest

from inferd.agent.config import AgentConfig, AgentConfigError
from inferd.server.approvals import ApprovalBroker


async def _ask_and_answer(broker: ApprovalBroker, approve: bool | None) -> str:
    waiting = asyncio.ensure_future(broker.ask("multiply", {"a": 6, "b": 7}, "req-1"))
    await asyncio.sleep(0)
    (pending,) = broker.pending.values()
    assert pending.listing()["tool"] == "multiply"
    assert pending.listing()["arguments"] == {"a": 6, "b": 7}
    if approve is not None:
        assert broker.answer(pending.id, approve)
        assert not broker.answer(pending.id, approve)  # answered once
    decision = await waiting
    assert broker.pending == {}
    return decision


@pytest.mark.parametrize(("approve", "decision"), [(True, "approved"), (False, "denied")])
def test_an_answer_settles_the_call(approve: bool, decision: str) -> None:
    assert asyncio.run(_ask_and_answer(ApprovalBroker(5), approve)) == decision


def test_an_unanswered_call_expires() -> None:
    assert asyncio.run(_ask_and_answer(ApprovalBroker(0.05), None)) == "expired"


def test_a_cancelled_wait_is_withdrawn() -> None:
    async def run() -> None:
        broker = ApprovalBroker(5)
        waiting = asyncio.ensure_future(broker.ask("multiply", {}, "req-2"))
        await asyncio.sleep(0)
        (approval_id,) = broker.pending
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert broker.pending == {}
        assert not broker.answer(approval_id, True)

    asyncio.run(run())


def test_unknown_ids_are_refused() -> None:
    assert not ApprovalBroker(5).answer("apr_missing", True)


@pytest.mark.parametrize("seconds", [0, -1, float("nan"), 86401])
def test_the_timeout_is_bounded(seconds: float) -> None:
    with pytest.raises(AgentConfigError, match="--agent-approval-timeout"):
        AgentConfig(approval_timeout_s=seconds)
