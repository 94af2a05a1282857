"""The approval broker of the agent loop: answered, denied, timed out, withdrawn."""

from __future__ import annotations

import asyncio

import pytest

from inferd.agent.config import AgentConfig, AgentConfigError
from inferd.server.approvals import ApprovalBroker, CallOrigin


async def _ask_and_answer(broker: ApprovalBroker, approve: bool | None) -> str:
    origin = CallOrigin("req-1", "owner-a", "s1")
    waiting = asyncio.ensure_future(broker.ask("multiply", {"a": 6, "b": 7}, origin))
    await asyncio.sleep(0)
    (pending,) = broker.pending.values()
    assert pending.listing()["tool"] == "multiply"
    assert pending.listing()["arguments"] == {"a": 6, "b": 7}
    assert pending.listing()["session_id"] == "s1"
    if approve is not None:
        assert not broker.answer(pending.id, approve, "owner-b")  # not another key's to answer
        assert broker.answer(pending.id, approve, "owner-a")
        assert not broker.answer(pending.id, approve, "owner-a")  # answered once
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
        waiting = asyncio.ensure_future(broker.ask("multiply", {}, CallOrigin("req-2")))
        await asyncio.sleep(0)
        (approval_id,) = broker.pending
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert broker.pending == {}
        assert not broker.answer(approval_id, True, None)

    asyncio.run(run())


def test_unknown_ids_are_refused() -> None:
    assert not ApprovalBroker(5).answer("apr_missing", True, None)


def test_each_key_sees_its_own_waiting_calls_and_a_session_its_own() -> None:
    async def run() -> None:
        broker = ApprovalBroker(5)
        origins = [CallOrigin("r1", "a", "s1"), CallOrigin("r2", "a"), CallOrigin("r3", "b", "s1")]
        waits = [asyncio.ensure_future(broker.ask("t", {}, o)) for o in origins]
        await asyncio.sleep(0)
        assert sorted(p.origin.request_id for p in broker.waiting("a")) == ["r1", "r2"]
        assert [p.origin.request_id for p in broker.waiting("a", "s1")] == ["r1"]
        assert [p.origin.request_id for p in broker.waiting("b")] == ["r3"]
        assert broker.waiting(None) == []
        for wait in waits:
            wait.cancel()
        await asyncio.gather(*waits, return_exceptions=True)

    asyncio.run(run())


@pytest.mark.parametrize("seconds", [0, -1, float("nan"), 86401])
def test_the_timeout_is_bounded(seconds: float) -> None:
    with pytest.raises(AgentConfigError, match="--agent-approval-timeout"):
        AgentConfig(approval_timeout_s=seconds)
