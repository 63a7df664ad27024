"""Automatic repair (meta/repair.py): a gone voter is replaced, one step at a time."""
from __future__ import annotations

from meta.controller import GroupReport, Refusal, SoftState
from meta.repair import REFUSAL_HOLD_MS, StartOperator, expired_assignments, repair
from meta.state import GroupRecord, OperatorRecord, WorkerRecord

LEASE, AFTER, RF = 1500, 60_000, 3
NOW = 200_000


def workers(*specs: tuple[str, str, str]) -> dict[str, WorkerRecord]:
    return {wid: WorkerRecord(wid, f"127.0.0.1:{7200 + i}", zone, state) for i, (wid, zone, state) in enumerate(specs)}


WORKERS = workers(("w1", "a", "active"), ("w2", "b", "active"), ("w3", "c", "active"), ("w4", "a", "active"),
                  ("w5", "c", "available"))


def group(gid: int = 0, voters: tuple[str, ...] = ("w1", "w2", "w3"), leader: str = "w1",
          learners: tuple[str, ...] = ()) -> GroupRecord:
    return GroupRecord(id=gid, term=4, leader=leader, voters=list(voters), learners=list(learners), ready_term=4)


def soft(silent: dict[str, int] | None = None, absent: tuple[str, ...] = ()) -> SoftState:
    """Everyone heard now, but `silent` (worker -> ms since last heard) and `absent` (never heard)."""
    s = SoftState(leader_since_ms=0)
    for wid in WORKERS:
        if wid in absent:
            continue
        s.heard_from(wid, NOW - (silent or {}).get(wid, 0), {0: GroupReport(term=4)})
    return s


def test_nothing_before_replace_after_ms_then_a_replica_on_the_best_worker() -> None:
    assert repair([group()], {}, WORKERS, soft({"w3": AFTER - 1}), NOW, LEASE, AFTER, RF) == []
    (act,) = repair([group()], {}, WORKERS, soft({"w3": AFTER}), NOW, LEASE, AFTER, RF)
    # Zone c is the gone voter's; w5 (zone c, available, hosting nothing) keeps the zones spread.
    assert (act.group, act.kind, act.worker) == (0, "add", "w5") and "w3 silent for 60000 ms" in act.reason


def test_zone_spread_beats_load_and_load_beats_id() -> None:
    gs = [group(), group(1, ("w5", "w2", "w4"), "w2")]  # w5 now hosts a replica
    (act,) = [a for a in repair(gs, {}, WORKERS, soft({"w3": AFTER}), NOW, LEASE, AFTER, RF) if a.group == 0]
    assert act.worker == "w5"  # the only one outside zones a and b
    ws = dict(WORKERS, w5=WorkerRecord("w5", "x", "a", "available"))
    (act,) = [a for a in repair(gs, {}, ws, soft({"w3": AFTER}), NOW, LEASE, AFTER, RF) if a.group == 0]
    assert act.worker == "w4"  # zones a, a: w4 and w5 both host one; the lower id


def test_once_the_replacement_is_a_voter_the_gone_one_is_removed() -> None:
    g = group(voters=("w1", "w2", "w3", "w5"))
    assert repair([g], {}, WORKERS, soft({"w3": AFTER}), NOW, LEASE, AFTER, RF) == [
        StartOperator(0, "remove", "w3", "w3 silent for 60000 ms; the group has 3 live voters")]


def test_declared_gone_needs_no_wait_and_never_hosts_the_replacement() -> None:
    ws = dict(WORKERS, w3=WorkerRecord("w3", "x", "c", "removed"))
    (act,) = repair([group()], {}, ws, soft(), NOW, LEASE, AFTER, RF)
    assert act.kind == "add" and "w3 was declared gone" in act.reason
    ws["w5"] = WorkerRecord("w5", "x", "c", "removed")
    (act,) = repair([group()], {}, ws, soft(), NOW, LEASE, AFTER, RF)
    assert act.worker == "w4"


def test_a_group_busy_unready_or_led_by_the_gone_worker_is_left_alone() -> None:
    s = soft({"w3": AFTER})
    op = {0: OperatorRecord(0, "add", "w4", "catch_up")}
    assert repair([group()], op, WORKERS, s, NOW, LEASE, AFTER, RF) == []
    unready = group()
    unready.ready_term = 3
    assert repair([unready], {}, WORKERS, s, NOW, LEASE, AFTER, RF) == []
    assert repair([group(leader="w3")], {}, WORKERS, s, NOW, LEASE, AFTER, RF) == []  # failover's business
    assert repair([group(learners=("w4",))], {}, WORKERS, s, NOW, LEASE, AFTER, RF) == []


def test_one_catch_up_per_worker_and_nothing_without_a_live_candidate() -> None:
    gs = [group(), group(1, ("w1", "w2", "w3"), "w2")]
    acts = repair(gs, {}, WORKERS, soft({"w3": AFTER}), NOW, LEASE, AFTER, RF)
    assert [(a.group, a.worker) for a in acts] == [(0, "w5"), (1, "w4")]
    s = soft({"w3": AFTER, "w4": AFTER, "w5": LEASE})
    assert repair([group()], {}, WORKERS, s, NOW, LEASE, AFTER, RF) == []


def test_a_new_meta_leader_counts_a_worker_it_never_heard_from_its_election() -> None:
    s = soft(absent=("w3",))
    s.leader_since_ms = NOW - AFTER + 1
    assert repair([group()], {}, WORKERS, s, NOW, LEASE, AFTER, RF) == []
    s.leader_since_ms = NOW - AFTER
    assert repair([group()], {}, WORKERS, s, NOW, LEASE, AFTER, RF)[0].kind == "add"


def test_two_gone_voters_are_replaced_one_after_the_other_before_either_is_removed() -> None:
    s = soft({"w2": AFTER, "w3": AFTER})
    (act,) = repair([group(voters=("w1", "w2", "w3", "w5"))], {}, WORKERS, s, NOW, LEASE, AFTER, RF)
    assert (act.kind, act.worker) == ("add", "w4")  # 2 live of RF 3: add before removing anything
    (act,) = repair([group(voters=("w1", "w2", "w3", "w4", "w5"))], {}, WORKERS, s, NOW, LEASE, AFTER, RF)
    assert (act.kind, act.worker) == ("remove", "w2")  # 3 live of the 4 that remain


def _drain(ws: dict[str, WorkerRecord], wid: str, state: str = "draining") -> dict[str, WorkerRecord]:
    out = dict(ws)
    out[wid] = WorkerRecord(wid, ws[wid].addr, ws[wid].zone, state)
    return out


def test_drain_hands_the_leadership_over_first() -> None:
    from meta.controller import StartTransfer

    s = soft()
    for wid, last in (("w2", 90), ("w3", 100)):
        s.workers[wid].groups[0] = GroupReport(term=4, last_seq=last)
    ws = _drain(WORKERS, "w1")
    assert repair([group()], {}, ws, s, NOW, LEASE, AFTER, RF) == [StartTransfer(0, "w1", "w3")]
    # Never to another worker on its way out.
    assert repair([group()], {}, _drain(ws, "w3"), s, NOW, LEASE, AFTER, RF) == [StartTransfer(0, "w1", "w2")]


def test_drain_replaces_a_follower_then_removes_it_then_says_drained() -> None:
    ws = _drain(WORKERS, "w3")
    (act,) = repair([group()], {}, ws, soft(), NOW, LEASE, AFTER, RF)
    assert (act.kind, act.worker, act.replaces, act.by) == ("add", "w5", "w3", "drain") and "w3 is draining" in act.reason
    (act,) = repair([group(voters=("w1", "w2", "w3", "w5"))], {}, ws, soft(), NOW, LEASE, AFTER, RF)
    assert (act.kind, act.worker, act.by) == ("remove", "w3", "drain")
    from meta.repair import SetWorkerState
    assert repair([group(voters=("w1", "w2", "w5"))], {}, ws, soft(), NOW, LEASE, AFTER, RF) == [
        SetWorkerState("w3", "drained", "w3 hosts no replica any more")]
    # An operator still involving it: not drained yet.
    assert repair([group(voters=("w1", "w2", "w5"))], {1: OperatorRecord(1, "remove", "w3", "remove")}, ws, soft(),
                  NOW, LEASE, AFTER, RF) == []


def failing(wid: str, since_ms: int) -> SoftState:
    """Everyone heard now; `wid` has reported group 0 failed since `since_ms` ago."""
    s = SoftState(leader_since_ms=0)
    for w in WORKERS:
        rep = GroupReport(term=4, failed="OSError: [Errno 28] No space left on device") if w == wid else \
            GroupReport(term=4)
        s.heard_from(w, NOW - since_ms, {0: rep})
        s.heard_from(w, NOW, {0: rep})
    return s


def test_a_replica_failed_for_replace_after_ms_is_replaced_and_one_that_recovers_is_not() -> None:
    assert repair([group()], {}, WORKERS, failing("w3", AFTER - 1), NOW, LEASE, AFTER, RF) == []
    s = failing("w3", AFTER)
    (act,) = repair([group()], {}, WORKERS, s, NOW, LEASE, AFTER, RF)
    assert (act.kind, act.worker, act.replaces, act.by) == ("add", "w5", "w3", "repair")
    assert "w3's replica has failed for 60000 ms (OSError: [Errno 28]" in act.reason
    # Then, with the replacement a voter, the failed (but live) replica goes.
    (act,) = repair([group(voters=("w1", "w2", "w3", "w5"))], {}, WORKERS, s, NOW, LEASE, AFTER, RF)
    assert (act.kind, act.worker) == ("remove", "w3")
    # A report without the failure (the worker reopened it in place) restarts the clock.
    s.heard_from("w3", NOW, {0: GroupReport(term=4)})
    assert repair([group()], {}, WORKERS, s, NOW, LEASE, AFTER, RF) == []
    s.heard_from("w3", NOW + 1, {0: GroupReport(term=4, failed="OSError")})
    assert repair([group()], {}, WORKERS, s, NOW + AFTER, LEASE, AFTER, RF) == []


def test_a_group_short_of_rf_is_filled_on_an_available_worker_first() -> None:
    busy = group(1, ("w3", "w4", "w2"), "w3")
    (act,) = repair([group(voters=("w1", "w2")), busy], {}, WORKERS, soft(), NOW, LEASE, AFTER, RF)
    # Zones a and b are used: w3 and w5 are in zone c; w5 (available) hosts nothing, w3 one replica.
    assert (act.group, act.kind, act.worker, act.by, act.replaces) == (0, "add", "w5", "fill", None)
    assert act.reason == "group 0 has 2 of 3 voters; adding one on w5"
    assert repair([group(voters=("w1", "w2"), learners=("w5",))], {}, WORKERS, soft(), NOW, LEASE, AFTER, RF) == []
    assert repair([group()], {}, WORKERS, soft(), NOW, LEASE, AFTER, RF) == []


def test_a_refusal_sends_the_replica_to_the_next_worker_until_it_expires() -> None:
    s = soft({"w3": AFTER})
    s.refused[(0, "w5")] = Refusal("insufficient_disk", NOW + 1)
    (act,) = repair([group()], {}, WORKERS, s, NOW, LEASE, AFTER, RF)
    assert act.worker == "w4"
    s.refused[(0, "w4")] = Refusal("draining", NOW + 1)
    assert repair([group()], {}, WORKERS, s, NOW, LEASE, AFTER, RF) == []  # nobody else can take it
    # Only that group: another group may still go to w5.
    acts = repair([group(), group(1)], {}, WORKERS, s, NOW, LEASE, AFTER, RF)
    assert [(a.group, a.worker) for a in acts] == [(1, "w5")]
    (act,) = repair([group()], {}, WORKERS, s, NOW + 1, LEASE, AFTER, RF)  # the hold is over
    assert act.worker == "w5"


def test_an_assignment_that_does_not_catch_up_in_time_is_given_up_and_its_learner_removed() -> None:
    s = soft({"w3": AFTER})
    ops = {0: OperatorRecord(0, "add", "w5", "catch_up", by="repair"),
           1: OperatorRecord(1, "add", "w4", "catch_up", by="operator"),
           2: OperatorRecord(2, "add", "w4", "catch_up", by="reconcile"),
           3: OperatorRecord(3, "add", "w2", "promote", by="fill")}
    s.note_operators([(op.group, op.kind, op.worker) for op in ops.values()], NOW)
    assert expired_assignments(ops, s, NOW + 299_999, 300_000) == []
    (cancel,) = expired_assignments(ops, s, NOW + 300_000, 300_000)
    assert (cancel.group, cancel.worker) == (0, "w5") and "within 300000 ms" in cancel.reason
    # A new meta leader starts the clock afresh; an ended operator is forgotten.
    s.note_operators([(1, "add", "w4")], NOW + 300_000)
    assert list(s.operator_seen_ms) == [(1, "add", "w4")]
    # Once refused, the learner it left goes first, then the replica is placed elsewhere.
    s.refused[(0, "w5")] = Refusal("timeout", NOW + REFUSAL_HOLD_MS)
    (act,) = repair([group(learners=("w5",))], {}, WORKERS, s, NOW, LEASE, AFTER, RF)
    assert (act.kind, act.worker) == ("remove", "w5") and "timeout" in act.reason
    (act,) = repair([group()], {}, WORKERS, s, NOW, LEASE, AFTER, RF)
    assert (act.kind, act.worker) == ("add", "w4")
