"""The Ray router's decisions (inferd/ray/routing.py), without Ray: hints from request bodies,
prefix digests, and the ranked choices."""

from __future__ import annotations

from inferd.ray.routing import (
    BLOCK_CHARS,
    AffinityTable,
    RouteHint,
    choose,
    prefix_digests,
    prompt_text,
    route_hint,
)

SYSTEM = "You answer questions about the museum. " * 20  # ~800 characters


def _chat(system: str, user: str) -> dict[str, object]:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def test_prompts_sharing_a_long_head_share_its_digests() -> None:
    a = prefix_digests(prompt_text(_chat(SYSTEM, "When do you open?")))
    b = prefix_digests(prompt_text(_chat(SYSTEM, "Where is the gift shop?")))
    c = prefix_digests(prompt_text(_chat("Another system prompt. " * 40, "When do you open?")))
    shared = len(SYSTEM) // BLOCK_CHARS
    assert shared >= 2 and a[:shared] == b[:shared]
    assert a[0] != c[0]
    # chained: a later block's digest differs when an earlier block does, even if it matches
    assert (
        prefix_digests("x" * BLOCK_CHARS + "y" * BLOCK_CHARS)[1]
        != prefix_digests("z" * BLOCK_CHARS + "y" * BLOCK_CHARS)[1]
    )


def test_short_prompts_have_no_prefix_key() -> None:
    assert prefix_digests(prompt_text(_chat("Be brief.", "Hi"))) == ()


def test_every_api_shape_gives_its_prompt_text() -> None:
    anthropic = {
        "system": SYSTEM,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    }
    responses = {"instructions": SYSTEM, "input": "Hi"}
    completions = {"prompt": SYSTEM + "Hi"}
    for body in (anthropic, responses, completions):
        assert prompt_text(body).startswith(SYSTEM), body


def test_session_key_from_header_user_or_metadata() -> None:
    assert route_hint({"user": "bob"}, {}).session == "bob"
    assert route_hint({"user": "bob"}, {"x-session-id": "s1"}).session == "s1"
    assert route_hint({"metadata": {"user_id": "u7"}}, {}).session == "u7"
    assert route_hint(b"not json", {"x-session-id": "s2"}).session == "s2"
    assert route_hint({"messages": []}, {}).session is None


def test_session_then_prefix_then_least_loaded() -> None:
    table = AffinityTable()
    loads = {"r1": 0, "r2": 0}
    digests = prefix_digests(SYSTEM)
    table.record(RouteHint(session="alice", prefix=digests), "r2")
    ranks, why = choose(table, RouteHint(session="alice"), loads, imbalance=4)
    assert (ranks[0], why) == (["r2"], "session")
    ranks, why = choose(table, RouteHint(prefix=digests[:1]), loads, imbalance=4)
    assert (ranks[0], why) == (["r2"], "prefix")
    ranks, why = choose(table, RouteHint(prefix=("unseen",)), {"r1": 3, "r2": 1}, imbalance=4)
    assert (ranks[0], why) == (["r2"], "least_loaded")


def test_a_busy_prefix_replica_is_passed_over() -> None:
    table = AffinityTable()
    digests = prefix_digests(SYSTEM)
    table.record(RouteHint(prefix=digests), "r1")
    ranks, why = choose(table, RouteHint(prefix=digests), {"r1": 9, "r2": 0}, imbalance=4)
    assert (ranks[0], why) == (["r2"], "least_loaded")


def test_a_dead_replica_loses_its_sessions_and_prefixes() -> None:
    table = AffinityTable()
    digests = prefix_digests(SYSTEM)
    table.record(RouteHint(session="alice", prefix=digests), "r1")
    ranks, why = choose(table, RouteHint(session="alice", prefix=digests), {"r2": 0}, 4)
    assert (ranks[0], why) == (["r2"], "least_loaded")  # r1 is not live
    table.forget("r1")
    assert table.sessions == {} and table.prefixes == {}


def test_a_fan_out_reaches_only_the_replica_it_names() -> None:
    table = AffinityTable()
    assert choose(table, RouteHint(replica="r2"), {"r1": 0, "r2": 5}, 4) == ([["r2"]], "replica")
    assert choose(table, RouteHint(replica="gone"), {"r1": 0}, 4) == ([], "replica")


def test_the_table_is_bounded() -> None:
    table = AffinityTable(max_entries=3)
    for i in range(5):
        table.record(RouteHint(session=f"s{i}"), "r1")
    assert list(table.sessions) == ["s2", "s3", "s4"]
