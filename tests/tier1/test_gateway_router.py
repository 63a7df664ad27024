"""The pure parts of the gateway: routing table, hints, deadline and retry policy, merge."""
from __future__ import annotations

import pytest

from gateway.router import (MIN_ATTEMPT_S, RESPONSE_MARGIN_S, GroupRoute, Hint, Next, RetryState, RoutingTable,
                            accept_hint, after_reply, attempt_budget, backoff_s, effective_leader, give_up,
                            merge_top_k, prune_hints)
from tests.tier1.test_gateway_fakes import make_view
from topology.routing import shard_for


def _table(revision: int = 5, term: int = 3, leader: str | None = "w1", live: dict[str, bool] | None = None
           ) -> RoutingTable:
    view = make_view(revision, 2, {"w1": "127.0.0.1:1", "w2": "127.0.0.1:2", "w3": "127.0.0.1:3"},
                     {0: {"leader": leader, "term": term, "voters": ["w1", "w2"], "learners": ["w3"], "ready": True},
                      1: {"leader": "w2", "term": 1, "voters": ["w2"], "ready": False}},
                     deadline_ms=1234, dim=8)
    for wid, flag in (live or {}).items():
        view["workers"][wid]["live"] = flag
    return RoutingTable.from_view(view)


def test_table_from_view() -> None:
    t = _table()
    assert (t.revision, t.shards, t.deadline_ms, t.embedding_dim, t.ack) == (5, 2, 1234, 8, "quorum")
    assert t.groups[0] == GroupRoute(0, 3, "w1", True, ("w1", "w2"), ("w3",))
    assert t.shard_for("foobar") == shard_for("foobar", 2) == 0x85944171F73967E8 % 2
    lt = t.leader_target(0)
    assert lt is not None and (lt.wid, lt.base, lt.term) == ("w1", "http://127.0.0.1:1", 3)
    assert t.leader_target(7) is None
    assert t.groups_without_ready_leader() == [1]
    assert [r.wid for r in t.replica_targets(0)] == ["w1", "w2", "w3"]
    assert [r.wid for r in _table(live={"w2": False}).replica_targets(0)] == ["w1", "w3"]
    assert _table(leader=None).leader_target(0) is None
    empty = RoutingTable.from_view({"revision": 0, "topology": None, "workers": {}, "groups": {}})
    assert empty.shards == 0 and empty.groups_without_ready_leader() == []


def test_hints() -> None:
    t = _table(term=3)
    g = t.groups[0]
    assert accept_hint(g, None, "w2", 3) == Hint(3, "w2")  # transfer in progress: same term
    assert accept_hint(g, None, "w2", 4) == Hint(4, "w2")
    assert accept_hint(g, None, "w2", 2) is None  # a stale replica
    assert accept_hint(g, None, "w2", None) == Hint(3, "w2")  # no term: the table's
    assert accept_hint(g, Hint(5, "w1"), "w2", 4) is None  # older than the hint we hold
    assert accept_hint(g, None, None, 4) is None and accept_hint(None, None, "w2", 4) is None
    assert effective_leader(g, Hint(3, "w2")) == ("w2", 3)
    assert effective_leader(g, Hint(2, "w2")) == ("w1", 3)
    hint_target = t.leader_target(0, Hint(4, "w2"))
    assert hint_target is not None and hint_target.wid == "w2"
    # A newer table term makes hints stale; an equal one keeps them.
    assert prune_hints({0: Hint(3, "w2"), 1: Hint(0, "w1"), 9: Hint(9, "w1")}, t) == {0: Hint(3, "w2")}


def test_attempt_budget_and_backoff() -> None:
    b = attempt_budget(1.0)
    assert b is not None and b.http_timeout_s == pytest.approx(1.0 - RESPONSE_MARGIN_S)
    assert b.worker_deadline_ms < b.http_timeout_s * 1000
    assert attempt_budget(RESPONSE_MARGIN_S + MIN_ATTEMPT_S / 2) is None
    assert attempt_budget(-1) is None
    pauses = [backoff_s(i, 10.0) for i in range(8)]
    assert pauses == sorted(pauses) and pauses[0] > 0 and pauses[-1] <= 0.1
    assert backoff_s(5, 0.02) < 0.02 - RESPONSE_MARGIN_S  # never past the budget
    assert backoff_s(0, 0.0) == 0.0


def test_reply_policy() -> None:
    assert after_reply(None, True, False) is Next.DONE
    assert after_reply("not_leader", True, True) is Next.RETRY
    assert after_reply("not_leader", True, False) is Next.BACKOFF
    assert after_reply("quorum_timeout", True, False) is Next.RETRY
    assert after_reply("deadline_exceeded", False, False) is Next.RETRY
    assert after_reply("unavailable", False, False) is Next.REFRESH
    # A full group: the answer at once (a follower read tries the other replicas first: Forwarder).
    assert after_reply("overloaded", True, False) is Next.DONE
    assert after_reply("overloaded", False, False) is Next.DONE
    # A leader without quorum: the new leader if meta named one, else answer now.
    assert after_reply("unavailable", True, False, "no_quorum", moved=True) is Next.RETRY
    assert after_reply("unavailable", True, False, "no_quorum", moved=False) is Next.GIVE_UP
    for code in ("bad_request", "not_found", "internal"):
        assert after_reply(code, True, False) is Next.DONE


def test_give_up_codes() -> None:
    assert give_up(RetryState(), True, 1).code == "unavailable"
    assert give_up(RetryState(maybe_applied=True), True, 1).code == "quorum_timeout"
    assert give_up(RetryState(maybe_applied=True), False, 1).code == "unavailable"
    assert give_up(RetryState(timed_out=True), False, 1).code == "deadline_exceeded"
    e = give_up(RetryState(attempts=3, last_leader="w2", last_term=4), True, 2)
    assert e.status == 503 and e.body()["error"] | {"message": ""} == {
        "code": "unavailable", "message": "", "shard": 2, "term": 4, "leader": "w2", "attempts": 3}
    e = give_up(RetryState(attempts=1, last_leader="w2", last_reason="no_quorum"), True, 2)
    assert e.code == "unavailable" and e.context["reason"] == "no_quorum" and "no quorum" in e.message
    e = give_up(RetryState(attempts=2, last_reason="no_quorum", maybe_applied=True), True, 2)
    assert e.code == "quorum_timeout"


def test_merge_top_k_orders_by_score_then_id() -> None:
    groups = [[{"id": "b", "score": 0.9}, {"id": "z", "score": 0.1}],
              [{"id": "a", "score": 0.9}, {"id": "c", "score": 0.5}],
              []]
    assert [h["id"] for h in merge_top_k(groups, 3)] == ["a", "b", "c"]
    assert merge_top_k(groups, 10)[-1]["id"] == "z" and merge_top_k([], 3) == []
