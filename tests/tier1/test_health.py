"""The health verdict's rules (shardgrid/health.py) on hand-built status dicts."""
from __future__ import annotations

import copy
from typing import Any

import pytest

from shardgrid.health import HealthPolicy, Verdict, assess, progress_key, render_health, software, software_warnings

VOTERS = ["w1", "w2", "w3"]


def rep(role: str = "follower", term: int = 3, commit: int = 100, applied: int = 100, **kw: Any) -> dict[str, Any]:
    """A worker's report of one group, as worker/group.py report() makes it."""
    out = {"term": term, "role": role, "leader": "w1", "ready": role == "leader", "quorum": True,
           "no_quorum_ms": None, "unheard": [], "leader_silence_ms": None if role == "leader" else 40,
           "last_term": term, "last_seq": commit, "commit": commit, "applied": applied, "failed": None,
           "resyncing": False}
    out.update(kw)
    return out


def healthy(groups: int = 2) -> dict[str, Any]:
    """Three meta nodes, three workers, `groups` groups on w1,w2,w3, each led by w1, all in step:
    the meta leader's view, as gather_status returns it."""
    gids = [str(i) for i in range(groups)]
    return {
        "topology": {"cluster": "c1", "replication_factor": 3, "settings": {"lease_ms": 1500}, "models": []},
        "revision": 9, "topology_revision": 1, "meta_leader": "m1", "served_by": "m1", "meta_leader_for_ms": 60000,
        # Each node's own Raft view as /v1/status gives it: connected to a majority, and to whom.
        "meta_nodes": [{"id": f"m{i}", "http": f"127.0.0.1:710{i}", "up": True, "role": "leader" if i == 1 else
                        "follower", "revision": 9, "has_quorum": True,
                        "peers": {f"m{j}": {"connected": True} for j in (1, 2, 3) if j != i}} for i in (1, 2, 3)],
        "groups": {gid: {"id": int(gid), "term": 3, "leader": "w1", "ready": True, "ready_term": 3,
                         "preferred_leader": "w1", "voters": list(VOTERS), "learners": [],
                         "desired": list(VOTERS)} for gid in gids},
        "operators": {},
        "workers": {wid: {"id": wid, "addr": f"127.0.0.1:720{i}", "zone": "abc"[i], "state": "active",
                          "admission": "admitted", "version": "0.1.0", "code_digest": "0123456789abcdef",
                          "live": True, "last_seen_ms_ago": 100,
                          "report": {"groups": {gid: rep("leader" if wid == "w1" else "follower") for gid in gids}}}
                    for i, wid in enumerate(VOTERS)},
        "gateways": [],
    }


def kinds(st: dict[str, Any]) -> list[tuple[str, str, str, str | None]]:
    return [(r.verdict.value, r.subject, r.kind, r.worker) for r in assess(st).reasons]


def test_a_cluster_in_step_is_green_with_no_reason() -> None:
    h = assess(healthy())
    assert h.verdict is Verdict.GREEN and h.reasons == () and h.warnings == ()
    assert [(r.group, r.worker, r.role, r.state) for r in h.replicas] == [
        (0, "w1", "leader", "ok"), (0, "w2", "voter", "ok"), (0, "w3", "voter", "ok"),
        (1, "w1", "leader", "ok"), (1, "w2", "voter", "ok"), (1, "w3", "voter", "ok")]
    assert render_health(h)[0].startswith("green")


def test_a_group_without_a_leader_is_red() -> None:
    st = healthy()
    st["groups"]["1"].update(leader=None, ready=False)
    assert assess(st).verdict is Verdict.RED
    assert ("red", "group 1", "no-leader", None) in kinds(st)
    assert all(k[1] != "group 0" for k in kinds(st))  # the other group is not blamed


def test_a_leader_that_has_not_finished_its_start_of_term_round_is_red() -> None:
    st = healthy()
    st["groups"]["0"].update(term=4, ready=False, ready_term=3)
    assert ("red", "group 0", "not-ready", "w1") in kinds(st)


def test_a_dead_leader_is_red_until_the_failover_and_a_dead_follower_only_yellow() -> None:
    st = healthy()
    st["workers"]["w1"].update(live=False, last_seen_ms_ago=4000)
    h = assess(st)
    assert h.verdict is Verdict.RED
    assert [k for k in kinds(st) if k[1] == "group 0"] == [("red", "group 0", "leader-down", "w1")]
    assert "last 4000 ms ago" in h.reasons[0].why
    # The controller moved the leadership to w2: w1 down is now one voter of three down.
    for g in st["groups"].values():
        g.update(leader="w2", term=4, ready_term=4)
    for gid in st["groups"]:
        st["workers"]["w2"]["report"]["groups"][gid] = rep("leader", term=4)
        st["workers"]["w3"]["report"]["groups"][gid] = rep(term=4, leader="w2")
    assert assess(st).verdict is Verdict.YELLOW
    assert kinds(st) == [("yellow", "group 0", "replica-down", "w1"), ("yellow", "group 1", "replica-down", "w1")]


def test_fewer_serving_voters_than_a_quorum_is_red_even_with_a_live_leader() -> None:
    st = healthy(groups=1)
    st["workers"]["w2"]["live"] = False
    st["workers"]["w3"]["report"]["groups"]["0"]["failed"] = "Unappliable: unknown op kind put_item_v2"
    ks = kinds(st)
    assert ks[0] == ("red", "group 0", "no-quorum", None)
    assert "1 of 3 voters can serve; a quorum needs 2" in assess(st).reasons[0].why
    assert ("yellow", "group 0", "replica-down", "w2") in ks and ("yellow", "group 0", "replica-failed", "w3") in ks


def test_a_leader_that_reports_it_lost_its_quorum_is_red() -> None:
    st = healthy(groups=1)
    st["workers"]["w1"]["report"]["groups"]["0"].update(quorum=False, no_quorum_ms=2300)
    assert kinds(st)[0] == ("red", "group 0", "leader-no-quorum", "w1")


def test_a_group_its_leader_has_not_reported_is_red_and_a_voter_not_reporting_yellow() -> None:
    st = healthy()
    del st["workers"]["w1"]["report"]["groups"]["1"]
    assert kinds(st) == [("red", "group 1", "leader-missing", "w1")]
    st = healthy()
    del st["workers"]["w2"]["report"]["groups"]["1"]
    assert kinds(st) == [("yellow", "group 1", "replica-missing", "w2")]
    # A worker live but without any report yet: every replica on it is "silent".
    st = healthy(groups=1)
    st["workers"]["w3"]["report"] = None
    assert kinds(st) == [("yellow", "group 0", "replica-silent", "w3")]


def test_a_stale_leader_report_does_not_speak_for_the_group() -> None:
    st = healthy(groups=1)
    # w1 still reports term 3 while meta moved the group to term 4 under w1: its unheard list is old news,
    # and nothing says w1 leads term 4 yet (until its next report does).
    st["groups"]["0"].update(term=4, ready_term=4)
    st["workers"]["w1"]["report"]["groups"]["0"]["unheard"] = ["w2"]
    h = assess(st)
    assert all(r.behind is None for r in h.replicas)
    assert kinds(st) == [("red", "group 0", "leader-not-leading", "w1")]
    assert "its last report is of term 3, not the group's term 4" in h.reasons[0].why
    st["workers"]["w1"]["report"]["groups"]["0"] = rep("leader", term=4)
    assert assess(st).verdict is Verdict.GREEN


@pytest.mark.parametrize("report, state", [
    ({"state": "failed", "failed": "OSError: disk error on the WAL"}, "failed"),
    ({"state": "closed"}, "closed"),
    ({"state": "corrupt", "error": "wal record 17: bad checksum"}, "corrupt"),
    (rep("leader", resyncing=True), "resyncing"),
    (None, "missing"),
    # The leader restarted: it holds the group's term as a follower and will never lead it
    # (meta/controller.py restarted_leader); meta has not moved the leadership yet.
    (rep("follower", ready=False), "not-leading"),
    (rep("leader", ready=False), "not-leading"),
])
def test_a_leader_that_cannot_serve_is_red_whatever_its_voters_do(report: dict[str, Any] | None,
                                                                   state: str) -> None:
    st = healthy(groups=1)
    if report is None:
        del st["workers"]["w1"]["report"]["groups"]["0"]
    else:
        st["workers"]["w1"]["report"]["groups"]["0"] = report
    assert kinds(st) == [("red", "group 0", f"leader-{state}", "w1")]
    lead = assess(st).replicas[0]
    assert (lead.worker, lead.role, lead.state, lead.serving) == ("w1", "leader", state, False)


def test_a_silent_leader_is_red() -> None:
    st = healthy(groups=1)
    st["workers"]["w1"]["report"] = None  # live, but no report of its groups yet
    assert kinds(st) == [("red", "group 0", "leader-silent", "w1")]


def test_a_voter_missing_from_the_group_is_under_replicated_yellow() -> None:
    st = healthy(groups=1)
    st["groups"]["0"]["voters"] = ["w1", "w2"]
    assert kinds(st) == [("yellow", "group 0", "under-replicated", None)]
    assert "2 of 3 voters (w1,w2)" in assess(st).reasons[0].why
    # A model group's own replication factor counts, not the topology's.
    st["topology"]["models"] = [{"name": "m", "replication_factor": 2, "groups": [{"id": 0, "first": 0, "last": 3}]}]
    assert assess(st).verdict is Verdict.GREEN


def test_a_learner_catching_up_and_its_operator_are_yellow() -> None:
    st = healthy(groups=1)
    st["workers"]["w4"] = {"addr": "127.0.0.1:7204", "zone": "a", "state": "active", "live": True,
                           "report": {"groups": {"0": rep(commit=40, applied=40)}}}
    st["groups"]["0"]["learners"] = ["w4"]
    st["operators"] = {"0": {"group": 0, "kind": "add", "worker": "w4", "step": "catch_up",
                             "message": "w4 receiving snapshot: 12 MB of 40 MB (30%)"}}
    h = assess(st)
    assert h.verdict is Verdict.YELLOW
    assert kinds(st) == [("yellow", "group 0", "learner", "w4"), ("yellow", "group 0", "operator", "w4")]
    assert "catch_up: w4 receiving snapshot" in h.reasons[1].why
    learner = next(r for r in h.replicas if r.worker == "w4")
    assert (learner.role, learner.behind) == ("learner", 60)  # the leader's last seq 100 - its commit 40


@pytest.mark.parametrize("change, state", [
    ({"state": "corrupt", "error": "wal record 17: bad checksum"}, "corrupt"),
    ({"failed": "OSError: disk full"}, "failed"),
    ({"resyncing": True}, "resyncing"),
    ({"leader_silence_ms": 1500}, "cut-off"),
])
def test_a_voter_that_cannot_serve_is_yellow_while_the_quorum_holds(change: dict[str, Any], state: str) -> None:
    st = healthy(groups=1)
    st["workers"]["w3"]["report"]["groups"]["0"].update(change)
    assert kinds(st) == [("yellow", "group 0", f"replica-{state}", "w3")]
    row = next(r for r in assess(st).replicas if r.worker == "w3")
    assert row.state == state and not row.serving


def test_a_voter_its_leader_does_not_hear_is_yellow() -> None:
    st = healthy(groups=1)
    st["workers"]["w1"]["report"]["groups"]["0"]["unheard"] = ["w3"]
    assert kinds(st) == [("yellow", "group 0", "replica-unheard", "w3")]


def test_lag_is_measured_per_replica_and_only_beyond_the_policy_counts() -> None:
    st = healthy(groups=1)
    st["workers"]["w1"]["report"]["groups"]["0"].update(last_seq=5000, commit=4990, applied=4990)
    st["workers"]["w2"]["report"]["groups"]["0"].update(commit=4900, applied=4500)
    st["workers"]["w3"]["report"]["groups"]["0"].update(commit=3000, applied=3000)
    h = assess(st)
    lag = {r.worker: (r.commit, r.applied, r.apply_lag, r.behind, r.state) for r in h.replicas}
    assert lag == {"w1": (4990, 4990, 0, 10, "ok"), "w2": (4900, 4500, 400, 100, "ok"),
                   "w3": (3000, 3000, 0, 2000, "lagging")}
    assert kinds(st) == [("yellow", "group 0", "replica-lagging", "w3")]
    # A lagging voter still acknowledges writes: it counts toward the quorum.
    st["workers"]["w2"]["live"] = False
    assert assess(st).verdict is Verdict.YELLOW
    # The threshold is the policy's: a stricter one makes w2's apply backlog lagging too.
    st["workers"]["w2"]["live"] = True
    strict = assess(st, HealthPolicy(max_lag=300))
    assert {r.worker for r in strict.replicas if r.state == "lagging"} == {"w2", "w3"}


def _meta_node_lost(st: dict[str, Any], mid: str) -> None:
    """Meta node `mid` is down: it answers nobody, and the leader m1 lost its connection to it."""
    node = next(n for n in st["meta_nodes"] if n["id"] == mid)
    node.clear()
    node.update(id=mid, http="x", up=False, error="ClientConnectorError")
    st["meta_nodes"][0]["peers"][mid]["connected"] = False


def test_meta_without_a_leader_is_red_and_a_meta_node_down_yellow() -> None:
    st = healthy()
    st["meta_leader"] = None
    assert kinds(st) == [("red", "meta", "meta-no-leader", None)]
    st = healthy()
    _meta_node_lost(st, "m3")
    assert kinds(st) == [("yellow", "meta", "meta-node-down", None)]
    assert "m3 not answering, nor connected to the meta leader m1; 2 of 3 connected (losing 1 more stops meta)" \
        in assess(st).reasons[0].why
    _meta_node_lost(st, "m2")
    st["meta_nodes"][0]["has_quorum"] = False
    assert kinds(st)[0] == ("red", "meta", "meta-no-majority", None)
    assert "the meta leader m1 reports no quorum: connected to 1 of 3" in assess(st).reasons[0].why


def test_meta_is_judged_by_its_leaders_raft_view_not_by_what_this_host_reaches() -> None:
    # m2 and m3 are firewalled from this host but connected to m1, which has its quorum: meta works.
    st = healthy()
    for node in st["meta_nodes"][1:]:
        node.clear()
        node.update(id=node.get("id") or "", up=False, error="TimeoutError")
    st["meta_nodes"][1]["id"], st["meta_nodes"][2]["id"] = "m2", "m3"
    assert kinds(st) == [("yellow", "meta", "meta-node-unreachable", None)]
    assert "m2,m3 unreachable from here, though connected to the meta leader m1" in assess(st).reasons[0].why
    # Without the leader's Raft view (an older meta), it is still only "unreachable from here".
    del st["meta_nodes"][0]["has_quorum"]
    assert kinds(st) == [("yellow", "meta", "meta-node-unreachable", None)]
    assert "m2,m3 unreachable from here; 1 of 3 answer" in assess(st).reasons[0].why
    # The leader itself unreachable from here: nothing says meta works.
    st = healthy()
    st["meta_nodes"][0].update(up=False, error="TimeoutError")
    assert kinds(st) == [("red", "meta", "meta-leader-unreachable", None)]
    assert "the meta leader m1 does not answer from here (TimeoutError); 2 of 3 nodes answer" in \
        assess(st).reasons[0].why


def test_right_after_a_meta_failover_unheard_workers_are_unknown_not_down() -> None:
    st = healthy(groups=1)
    st["meta_leader_for_ms"] = 300  # the new meta leader has heard nobody yet
    for w in st["workers"].values():
        w.update(live=False, last_seen_ms_ago=None)
    h = assess(st)
    assert h.verdict is Verdict.YELLOW
    assert kinds(st) == [("yellow", "group 0", "leader-unconfirmed", "w1"),
                         ("yellow", "group 0", "replica-unconfirmed", "w2"),
                         ("yellow", "group 0", "replica-unconfirmed", "w3")]
    assert "took over 300 ms ago (within its first 1500 ms lease): unknown, not down" in h.reasons[0].why
    # Past its first lease, a worker it never heard is down: the leader's group is red.
    st["meta_leader_for_ms"] = 1600
    assert kinds(st)[0] == ("red", "group 0", "leader-down", "w1")
    assert "(none since meta's leader started)" in assess(st).reasons[0].why
    # Within the first lease, voters it did hear and found down still count: 1 known down,
    # 2 unknown leaves a quorum possible (yellow); 2 known down do not (red).
    st["meta_leader_for_ms"] = 300
    st["workers"]["w2"]["last_seen_ms_ago"] = 2000
    assert assess(st).verdict is Verdict.YELLOW
    st["workers"]["w3"]["last_seen_ms_ago"] = 2000
    assert ("red", "group 0", "no-quorum", None) in kinds(st)
    # An older meta says nothing of when it took over: unknown, yellow.
    del st["meta_leader_for_ms"]
    st["workers"]["w3"]["last_seen_ms_ago"] = None
    assert assess(st).verdict is Verdict.YELLOW


def test_a_view_without_reports_is_at_best_yellow_but_still_sees_meta_records() -> None:
    st = healthy()
    for w in st["workers"].values():
        del w["report"], w["live"], w["last_seen_ms_ago"]
    h = assess(st)
    assert h.verdict is Verdict.YELLOW and not h.reports and h.replicas == ()
    assert kinds(st) == [("yellow", "replicas", "reports-unknown", None)]
    st["groups"]["0"].update(leader=None, ready=False)
    assert assess(st).verdict is Verdict.RED


def test_no_topology_is_red() -> None:
    st = healthy()
    st.update(topology=None, groups={})
    assert kinds(st) == [("red", "topology", "no-groups", None)]


def test_group_ids_may_be_ints_as_meta_builds_them() -> None:
    st = healthy()
    st["groups"] = {int(k): v for k, v in st["groups"].items()}
    st["operators"] = {1: {"group": 1, "kind": "remove", "worker": "w3", "step": "remove", "message": ""}}
    assert kinds(st) == [("yellow", "group 1", "operator", "w3")]


def test_mixed_software_is_a_warning_not_a_verdict() -> None:
    st = healthy()
    st["workers"]["w3"]["code_digest"] = "fedcba9876543210"
    st["gateways"] = [{"id": "g1", "version": "0.1.0", "code_digest": "fedcba9876543210"}]
    h = assess(st)
    assert h.verdict is Verdict.GREEN
    assert h.warnings == ("mixed software: 0.1.0 (01234567) on w1,w2; 0.1.0 (fedcba98) on w3,g1 "
                          "(expected during a rolling upgrade; finish it)",)
    assert any(line.startswith("  warning mixed software") for line in render_health(h))
    # A revoked or removed worker is out of service: its build does not count.
    st = healthy()
    st["workers"]["w3"].update(code_digest="fedcba9876543210", admission="revoked")
    assert software_warnings(st) == []


def test_a_down_worker_hosting_nothing_is_a_warning() -> None:
    st = healthy()
    st["workers"]["w4"] = {"addr": "x", "zone": "a", "state": "available", "live": False, "report": None}
    h = assess(st)
    assert h.verdict is Verdict.GREEN and h.warnings == ("worker w4 is not live (it hosts no replica)",)


def test_verdicts_order_and_render_red_reasons_first() -> None:
    assert Verdict.GREEN.at_least(Verdict.YELLOW) and Verdict.YELLOW.at_least(Verdict.YELLOW)
    assert not Verdict.RED.at_least(Verdict.YELLOW) and not Verdict.YELLOW.at_least(Verdict.GREEN)
    st = healthy()
    st["groups"]["0"]["voters"] = ["w1", "w2"]
    st["groups"]["1"].update(leader=None, ready=False)
    lines = render_health(assess(st))
    assert lines[0] == "red: 1 red, 1 yellow reasons"
    assert lines[1].split()[:3] == ["red", "group", "1:"] and lines[2].split()[:3] == ["yellow", "group", "0:"]


def test_progress_changes_with_the_rules_not_with_numbers_in_their_text() -> None:
    st = healthy(groups=1)
    st["workers"]["w1"]["report"]["groups"]["0"].update(last_seq=5000, commit=5000, applied=5000)
    st["workers"]["w3"]["report"]["groups"]["0"].update(commit=10, applied=10)  # lagging
    before = assess(st)
    moved = copy.deepcopy(st)
    moved["workers"]["w3"]["report"]["groups"]["0"].update(commit=20, applied=20)
    after = assess(moved)
    assert before.reasons != after.reasons and progress_key(before) == progress_key(after)
    moved["workers"]["w3"]["live"] = False
    assert progress_key(assess(moved)) != progress_key(before)


def test_to_dict_is_plain_data() -> None:
    st = healthy(groups=1)
    st["groups"]["0"]["voters"] = ["w1", "w2"]
    d = assess(st).to_dict()
    assert d["verdict"] == "yellow" and d["reasons"][0]["verdict"] == "yellow"
    assert d["reasons"][0]["kind"] == "under-replicated" and d["replicas"][0]["worker"] == "w1"


def test_a_meta_node_on_another_version_is_a_warning() -> None:
    st = healthy()
    for node in st["meta_nodes"]:
        node["version"] = "0.1.0"
    assert software_warnings(st) == []  # meta reports no digest: the same version is the same software
    st["meta_nodes"][2]["version"] = "0.2.0"
    assert software_warnings(st) == ["mixed meta versions: 0.1.0 on m1,m2; 0.2.0 on m3; "
                                     "workers and gateways run 0.1.0"]
    # Every meta node upgraded, the workers not yet: still mixed.
    for node in st["meta_nodes"]:
        node["version"] = "0.2.0"
    assert software_warnings(st) == ["mixed meta versions: 0.2.0 on m1,m2,m3; workers and gateways run 0.1.0"]
    # A node that is down reports nothing to compare.
    st["meta_nodes"][0].update(up=False, version="0.1.0")
    assert all("m1" not in w for w in software_warnings(st))


def test_a_removed_or_revoked_workers_version_does_not_make_meta_look_mixed() -> None:
    st = healthy()
    for node in st["meta_nodes"]:
        node["version"] = "0.2.0"
    for w in st["workers"].values():
        w["version"] = "0.2.0"
    assert software_warnings(st) == []
    # Old workers out of service still carry the version they registered with: it is not served.
    st["workers"]["w4"] = {"addr": "x", "zone": "a", "state": "removed", "version": "0.1.0", "live": False}
    st["workers"]["w5"] = {"addr": "y", "zone": "a", "state": "active", "admission": "revoked", "version": "0.1.0"}
    assert software_warnings(st) == []


def test_one_rendering_of_a_build_for_the_verdict_and_the_table() -> None:
    assert software({"version": "0.1.0", "code_digest": "0123456789abcdef"}) == "0.1.0 (01234567)"
    assert software({"code_digest": "0123456789abcdef"}) == "? (01234567)"
    assert software({"version": "0.1.0"}) == "0.1.0"
    assert software({}) == "-"
    from shardgrid import topoctl
    assert not hasattr(topoctl, "_software")  # topoctl's table uses the same function
