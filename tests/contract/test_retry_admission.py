"""The retry policy for length-limited runs and the weighted admission permit (seed 000's
open exercises), on fixture streams through the strict consumer and on real threads."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import pytest

from inferd.contract.admission import AdmissionPool, PermitRefused, request_weight
from inferd.contract.fixtures import INFERD_ROUTE, inferd_items, render
from inferd.contract.request import ChatRequest, RequestBounds, TextPart, build_chat_request
from inferd.contract.retry import LengthRetryPolicy, RetryError, retry_length_limited
from inferd.contract.staging import Modality
from inferd.contract.stream import Complete, Expectation, IncompleteLengthLimited, Outcome
from tests.contract.helpers import consume, inferd_plan

BOUNDS = RequestBounds(
    max_prompt_bytes=4096,
    max_media_parts=0,
    max_media_bytes=0,
    max_output_tokens=256,
    max_json_bytes=1 << 20,
    modalities=frozenset({Modality.TEXT}),
)
NEEDED = 24  # the fixture "server" answers completely given at least this budget


def _build(request_id: str, max_tokens: int, text: str = "Tell a story.") -> ChatRequest:
    return build_chat_request(
        inferd_plan(),
        request_id=request_id,
        tenant="t",
        parts=(TextPart(text),),
        max_tokens=max_tokens,
        temperature=0.0,
        seed=7,
        bounds=BOUNDS,
    )


def _server(sent: list[ChatRequest]) -> Callable[[ChatRequest], Outcome]:
    """The stream a server writes for each request: cut at its budget under NEEDED tokens."""

    def send(request: ChatRequest) -> Outcome:
        sent.append(request)
        finish = "length" if request.max_tokens < NEEDED else "stop"
        tokens = min(request.max_tokens, NEEDED)
        expect = Expectation(INFERD_ROUTE, request.max_tokens, True)
        return consume([render(inferd_items(finish, tokens))], expect)[0]

    return send


def test_a_length_limited_run_is_not_retried_unless_the_product_allows_it() -> None:
    sent: list[ChatRequest] = []
    run = retry_length_limited(
        _build, _server(sent), request_id="q", max_tokens=8, policy=LengthRetryPolicy()
    )
    assert [r.request_id for r in run.runs] == ["q"]
    assert isinstance(run.outcome, IncompleteLengthLimited) and not run.outcome.ok


def test_retries_are_new_runs_raising_only_the_budget_up_to_the_ceiling() -> None:
    sent: list[ChatRequest] = []
    policy = LengthRetryPolicy(allowed=True, ceiling=64, growth=2.0, max_runs=4)
    run = retry_length_limited(_build, _server(sent), request_id="q", max_tokens=8, policy=policy)
    assert [(r.request_id, r.max_tokens) for r in run.runs] == [
        ("q", 8),
        ("q-r1", 16),
        ("q-r2", 32),
    ]
    assert [type(r.outcome) for r in run.runs] == [
        IncompleteLengthLimited,
        IncompleteLengthLimited,
        Complete,
    ]
    bodies = [json.loads(r.body) for r in sent]
    assert [b.pop("max_tokens") for b in bodies] == [8, 16, 32]
    assert bodies[0] == bodies[1] == bodies[2]  # the same model and input every run


def test_at_the_ceiling_the_outcome_stays_length_limited() -> None:
    sent: list[ChatRequest] = []
    policy = LengthRetryPolicy(allowed=True, ceiling=12, max_runs=5)
    run = retry_length_limited(_build, _server(sent), request_id="q", max_tokens=8, policy=policy)
    assert [r.max_tokens for r in run.runs] == [8, 12]
    assert isinstance(run.outcome, IncompleteLengthLimited) and not run.outcome.ok


def test_a_retry_that_changes_the_input_or_reuses_the_id_is_refused() -> None:
    policy = LengthRetryPolicy(allowed=True, ceiling=64)
    drifting = lambda rid, n: _build(rid, n, "Tell a story." if rid == "q" else "Other.")  # noqa: E731
    with pytest.raises(RetryError, match="changed more than max_tokens"):
        retry_length_limited(drifting, _server([]), request_id="q", max_tokens=8, policy=policy)
    same_id = lambda rid, n: _build("q", n)  # noqa: E731
    with pytest.raises(RetryError, match="must be a new run"):
        retry_length_limited(same_id, _server([]), request_id="q", max_tokens=8, policy=policy)


def test_a_policy_that_cannot_hold_is_refused() -> None:
    with pytest.raises(RetryError, match="ceiling"):
        LengthRetryPolicy(allowed=True)
    with pytest.raises(RetryError, match="growth"):
        LengthRetryPolicy(growth=1.0)


def test_weight_counts_prompt_media_and_output_budget() -> None:
    short, long = _build("a", 16, "Hi."), _build("b", 16, "x" * 2000)
    assert request_weight(long) - request_weight(short) >= 2000 // 4 - 1
    more = request_weight(_build("c", 200, "Hi.")) - request_weight(short)
    assert 184 <= more <= 185  # the budget's 184 more tokens (and one more digit of body)


def test_permits_bound_the_weight_in_flight_across_threads() -> None:
    pool = AdmissionPool(capacity=100)
    peak, lock = [0], threading.Lock()

    def worker(weight: int) -> None:
        with pool.permit(weight, timeout=10):
            with lock:
                peak[0] = max(peak[0], pool.in_use)
            time.sleep(0.02)

    threads = [threading.Thread(target=worker, args=(w,)) for w in [60, 30, 50, 20, 70] * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 0 < peak[0] <= 100
    assert pool.in_use == 0  # every permit went back


def test_a_heavy_request_is_served_in_its_turn_not_starved() -> None:
    pool = AdmissionPool(capacity=10)
    order: list[str] = []
    first = pool.permit(6, timeout=1)
    first.__enter__()

    def take(name: str, weight: int) -> None:
        with pool.permit(weight, timeout=5):
            order.append(name)
            time.sleep(0.01)

    heavy = threading.Thread(target=take, args=("heavy", 10))
    heavy.start()
    time.sleep(0.05)  # heavy waits first; light (4) would fit beside the first at once
    light = threading.Thread(target=take, args=("light", 4))
    light.start()
    time.sleep(0.05)
    assert order == []  # light queues behind heavy though it would fit
    first.__exit__(None, None, None)
    heavy.join()
    light.join()
    assert order == ["heavy", "light"]


def test_permits_refuse_what_can_never_fit_too_many_waiting_and_a_timeout() -> None:
    pool = AdmissionPool(capacity=10, max_waiting=1)
    with pytest.raises(PermitRefused, match="can never fit"):
        pool.permit(11, timeout=1).__enter__()
    with pool.permit(10, timeout=1):
        refused: list[str] = []
        waiter = threading.Thread(target=_refused, args=(pool, 0.3, refused))
        waiter.start()
        time.sleep(0.05)
        with pytest.raises(PermitRefused, match="1 requests already wait"):
            _hold(pool, 1)
        waiter.join()
        assert refused == ["no permit of weight 5 within 0.3s"]  # it waited, then timed out
        with pytest.raises(PermitRefused, match=r"within 0\.05s"):
            _hold(pool, 0.05)
    assert pool.in_use == 0


def _hold(pool: AdmissionPool, timeout: float) -> None:
    with pool.permit(5, timeout=timeout):
        pass


def _refused(pool: AdmissionPool, timeout: float, refused: list[str]) -> None:
    try:
        _hold(pool, timeout)
    except PermitRefused as exc:
        refused.append(str(exc))
