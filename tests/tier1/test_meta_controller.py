"""The controller's failover decision (a pure function)."""
from __future__ import annotations

from meta.controller import (BOOTSTRAP_GRACE_MS, ISOLATION_HOLD_LEASES, REBALANCE_AFTER_MS, GroupReport, SetLeader,
                             SoftState, StartTransfer, UpdateOperator, advance_operator, decide, rebalance)
from meta.progress import snapshot_message
from meta.state import GroupRecord, OperatorRecord

LEASE = 1500


def groups() -> list[GroupRecord]:
    return [GroupRecord(id=i, term=5, leader=f"w{i + 1}", voters=["w1", "w2", "w3"], preferred_leader=f"w{i + 1}",
                        ready_term=5) for i in range(3)]


def soft_with(now: int, seen: dict[str, int], reports: dict[str, dict[int, tuple[int, int]]] | None = None) -> SoftState:
    soft = SoftState(leader_since_ms=0)
    for wid, at in seen.items():
        reps = {gid: GroupReport(term=5, last_term=t, last_seq=s) for gid, (t, s) in (reports or {}).get(wid, {}).items()}
        soft.heard_from(wid, at, reps)
    return soft


def test_no_action_while_everyone_is_live() -> None:
    now = 10_000
    assert decide(groups(), soft_with(now, {"w1": now, "w2": now, "w3": now}), now, LEASE) == []


def test_only_the_dead_workers_groups_fail_over() -> None:
    now = 10_000
    soft = soft_with(now, {"w1": now - LEASE - 1, "w2": now, "w3": now},
                     {"w2": {0: (5, 100)}, "w3": {0: (5, 90)}})
    actions = decide(groups(), soft, now, LEASE)
    assert actions == [SetLeader(group=0, leader="w2", expect_term=5, reason="leader w1 silent for 1500 ms")]


def test_most_up_to_date_live_voter_wins_term_before_seq() -> None:
    now = 10_000
    soft = soft_with(now, {"w1": 0, "w2": now, "w3": now}, {"w2": {0: (4, 500)}, "w3": {0: (5, 10)}})
    (action,) = decide(groups(), soft, now, LEASE)
    assert action.leader == "w3"


def test_tie_prefers_the_preferred_leader_then_lowest_id() -> None:
    now = 10_000
    gs = [GroupRecord(id=0, term=2, leader="w1", voters=["w1", "w2", "w3"], preferred_leader="w3", ready_term=2)]
    soft = soft_with(now, {"w2": now, "w3": now}, {"w2": {0: (2, 7)}, "w3": {0: (2, 7)}})
    assert decide(gs, soft, now, LEASE)[0].leader == "w3"
    gs[0].preferred_leader = "w1"
    assert decide(gs, soft, now, LEASE)[0].leader == "w2"


def test_a_new_meta_leader_waits_a_full_lease() -> None:
    soft = SoftState(leader_since_ms=10_000)
    soft.heard_from("w2", 10_100, {})
    # w1 and w3 never heard from; w2 is live, but the lease since election has not passed.
    assert decide(groups(), soft, 10_000 + LEASE - 1, LEASE) == []
    after = decide(groups(), soft, 10_100 + LEASE - 1, LEASE)
    assert {a.group for a in after} == {0, 2} and all(a.leader == "w2" for a in after)


def _restart_soft(now: int, w1: GroupReport) -> SoftState:
    soft = SoftState(leader_since_ms=0)
    soft.heard_from("w1", now, {0: w1})
    for wid in ("w2", "w3"):
        soft.heard_from(wid, now, {0: GroupReport(term=5, role="follower", last_term=5, last_seq=90)})
    return soft


def test_a_leader_that_restarted_within_its_lease_is_failed_over() -> None:
    """Live, but it holds the group's term as a follower: it will never lead that term again."""
    now = 10_000
    gs = groups()[:1]
    soft = _restart_soft(now, GroupReport(term=5, role="follower", last_term=5, last_seq=100))
    # Another live voter takes it even though w1's log is longer (the Begin
    # round fetches what it lacks): a worker restarting in a loop must not win
    # its groups back every time. Leader balance returns them later.
    assert decide(gs, soft, now, LEASE) == [
        SetLeader(group=0, leader="w2", expect_term=5, reason="leader w1 holds term 5 as a follower (restarted)")]
    soft = _restart_soft(now, GroupReport(term=5, role="follower", last_term=5, last_seq=80))
    assert [(a.leader, a.expect_term) for a in decide(gs, soft, now, LEASE)] == [("w2", 5)]
    # A report, not silence: no need to wait a lease after a meta election...
    soft.leader_since_ms = now - 1
    assert [(a.leader, a.expect_term) for a in decide(gs, soft, now, LEASE)] == [("w2", 5)]
    # ...but only voters that have reported are candidates: w2 and w3 are not heard yet.
    fresh = SoftState(leader_since_ms=now - 1)
    fresh.heard_from("w1", now, {0: GroupReport(term=5, role="follower", last_term=5, last_seq=80)})
    assert [a.leader for a in decide(gs, fresh, now, LEASE)] == ["w1"]
    fresh.heard_from("w3", now, {0: GroupReport(term=5, role="follower", last_term=5, last_seq=70)})
    assert [a.leader for a in decide(gs, fresh, now, LEASE)] == ["w3"]


def test_a_restarted_leader_with_nobody_else_live_leads_again_in_the_next_term() -> None:
    now = 10_000
    one = [GroupRecord(id=0, term=3, leader="w1", voters=["w1"], preferred_leader="w1", ready_term=3)]
    soft = SoftState(leader_since_ms=0)
    soft.heard_from("w1", now, {0: GroupReport(term=3, role="follower", last_term=3, last_seq=9)})
    assert [(a.leader, a.expect_term) for a in decide(one, soft, now, LEASE)] == [("w1", 3)]
    gs = groups()[:1]
    soft = _restart_soft(now, GroupReport(term=5, role="follower", last_term=5, last_seq=100))
    soft.heard_from("w2", now, {0: GroupReport(term=5, role="follower", last_term=5, last_seq=90, resyncing=True)})
    soft.heard_from("w3", now - LEASE, {})  # silent
    assert [a.leader for a in decide(gs, soft, now, LEASE)] == ["w1"]


def test_a_leader_on_its_way_up_or_leading_is_left_alone() -> None:
    now = 10_000
    gs = groups()[:1]
    for report in (GroupReport(term=5, role="leader", last_term=5, last_seq=100),
                   GroupReport(term=5, role="candidate", last_term=4, last_seq=100),
                   GroupReport(term=4, role="follower", last_term=4, last_seq=100),  # the new term not seen yet
                   GroupReport(term=5, last_term=5, last_seq=100)):  # no role reported
        assert decide(gs, _restart_soft(now, report), now, LEASE) == [], report


def test_no_live_voter_means_no_action() -> None:
    now = 10_000
    assert decide(groups(), soft_with(now, {"w1": 0, "w2": 0, "w3": 0}), now, LEASE) == []


def test_non_voters_are_never_chosen() -> None:
    now = 10_000
    gs = [GroupRecord(id=0, term=1, leader="w1", voters=["w1", "w2", "w3"], learners=["w4"], ready_term=1)]
    soft = soft_with(now, {"w4": now}, {"w4": {0: (1, 999)}})
    assert decide(gs, soft, now, LEASE) == []


def test_a_group_that_never_had_a_ready_leader_gets_the_bootstrap_grace() -> None:
    from meta.controller import BOOTSTRAP_GRACE_MS

    fresh = [GroupRecord(id=0, term=1, leader="w1", voters=["w1", "w2", "w3"])]  # ready_term 0: no data yet
    soft = SoftState(leader_since_ms=0)
    soft.know("w1", 0)
    soft.heard_from("w2", BOOTSTRAP_GRACE_MS - 10, {})
    assert decide(fresh, soft, LEASE * 3, LEASE) == []
    (action,) = decide(fresh, soft, BOOTSTRAP_GRACE_MS, LEASE)
    assert action.leader == "w2" and "10000 ms" in action.reason


def test_a_resyncing_replica_never_leads() -> None:
    now = 10_000
    gs = groups()
    soft = SoftState(leader_since_ms=0)
    soft.heard_from("w1", now, {0: GroupReport(term=5, role="follower", last_term=5, last_seq=1, resyncing=True)})
    soft.heard_from("w2", now, {0: GroupReport(term=5, last_term=5, last_seq=90)})
    soft.heard_from("w3", now, {0: GroupReport(term=5, last_term=5, last_seq=80)})
    # w1 leads group 0 but reports it lost its log: its group moves, to the best intact voter.
    (action,) = [a for a in decide(gs, soft, now, LEASE) if a.group == 0]
    assert action.leader == "w2" and "re-syncs" in action.reason
    # And a resyncing voter is never the pick, however far ahead it claims to be.
    soft.heard_from("w2", now, {0: GroupReport(term=5, last_term=9, last_seq=999, resyncing=True)})
    (action,) = [a for a in decide(gs, soft, now, LEASE) if a.group == 0]
    assert action.leader == "w3"


def test_a_failed_replica_never_leads() -> None:
    now = 10_000
    gs = groups()
    soft = SoftState(leader_since_ms=0)
    # w1 heartbeats as usual, but its replica of group 0 stopped on a disk error.
    soft.heard_from("w1", now, {0: GroupReport(term=5, role="leader", last_term=5, last_seq=90,
                                                failed="OSError: [Errno 5] EIO")})
    soft.heard_from("w2", now, {0: GroupReport(term=5, last_term=5, last_seq=80)})
    soft.heard_from("w3", now, {0: GroupReport(term=5, last_term=5, last_seq=85, failed="OSError: [Errno 28]")})
    (action,) = [a for a in decide(gs, soft, now, LEASE) if a.group == 0]
    assert action.leader == "w2" and "replica failed: OSError: [Errno 5] EIO" in action.reason
    # Nor does leadership go back to a preferred leader whose replica failed.
    gs[0].leader, gs[0].term, gs[0].ready_term = "w2", 6, 6
    for t in range(now, now + REBALANCE_AFTER_MS + 1, 500):
        soft.heard_from("w2", t, {0: GroupReport(term=6, role="leader", last_term=6, last_seq=91, commit=91)})
        soft.heard_from("w1", t, {0: GroupReport(term=6, last_term=6, last_seq=91, failed="OSError: [Errno 5] EIO")})
    later = now + REBALANCE_AFTER_MS
    assert rebalance(gs, soft, later, LEASE) == []
    soft.heard_from("w1", later, {0: GroupReport(term=6, last_term=6, last_seq=91)})  # restarted, healthy
    assert rebalance(gs, soft, later, LEASE) == [StartTransfer(0, "w2", "w1")]


def test_transfer_lag_allowance_grows_with_the_leaders_write_rate() -> None:
    from meta.controller import CATCH_UP_LAG, transfer_lag_allowed

    assert transfer_lag_allowed(GroupReport(commit=500), 1500) == CATCH_UP_LAG  # idle leader: the fixed bound
    # 400 writes/s reported a lease (1.5 s) apart can put the target 600 entries behind the commit
    assert transfer_lag_allowed(GroupReport(commit=500, write_rate=400.0), 1500) == CATCH_UP_LAG + 600
    assert transfer_lag_allowed(GroupReport(write_rate=-5.0), 1500) == CATCH_UP_LAG


# -- leader balance ---------------------------------------------------------------------------

def _balanced_soft(now: int, up_since: int, commit: int = 100, pref_seq: int = 100) -> SoftState:
    """w1 is back (live since `up_since`) after w2 took over group 0 at term 6."""
    soft = SoftState(leader_since_ms=0)
    for wid in ("w1", "w2", "w3"):
        soft.heard_from(wid, up_since if wid == "w1" else 0, {}, LEASE)
    for t in range(max(up_since, 0), now + 1, 500):
        for wid in ("w1", "w2", "w3"):
            if wid != "w1" or t >= up_since:
                seq = pref_seq if wid == "w1" else commit
                soft.heard_from(wid, t, {0: GroupReport(term=6, last_term=6, last_seq=seq, commit=commit,
                                                        role="leader" if wid == "w2" else "follower")}, LEASE)
    return soft


def _moved() -> list[GroupRecord]:
    gs = groups()
    gs[0].term, gs[0].ready_term, gs[0].leader = 6, 6, "w2"  # failed over from w1, its preferred leader
    return gs


def test_leadership_goes_back_to_the_preferred_leader_once_it_has_been_up_long_enough() -> None:
    now = 60_000
    assert rebalance(_moved(), _balanced_soft(now, now - REBALANCE_AFTER_MS), now, LEASE) == [
        StartTransfer(group=0, leader="w2", target="w1")]
    # up for less than REBALANCE_AFTER_MS: not yet
    assert rebalance(_moved(), _balanced_soft(now, now - REBALANCE_AFTER_MS + 500), now, LEASE) == []


def test_a_gap_in_heartbeats_restarts_the_wait() -> None:
    now = 60_000
    soft = _balanced_soft(now, 0)
    assert soft.workers["w1"].up_since_ms == 0
    soft.heard_from("w1", now + LEASE + 1, soft.workers["w1"].groups, LEASE)  # silent for more than a lease
    assert soft.workers["w1"].up_since_ms == now + LEASE + 1
    assert rebalance(_moved(), soft, now + LEASE + 2, LEASE) == []


def test_a_restart_restarts_the_wait_even_within_a_lease() -> None:
    soft = SoftState(leader_since_ms=0)
    soft.heard_from("w1", 0, {}, LEASE, boot="a")
    soft.heard_from("w1", 500, {}, LEASE, boot="a")
    assert soft.workers["w1"].up_since_ms == 0
    soft.heard_from("w1", 1000, {}, LEASE, boot="b")  # a new process, back within the lease
    assert soft.workers["w1"].up_since_ms == 1000
    soft.heard_from("w1", 1500, {}, LEASE)  # no boot id (an older worker): judged by gaps alone
    assert soft.workers["w1"].up_since_ms == 1000


def test_no_move_for_a_lagging_busy_unready_or_non_voter_preferred_leader() -> None:
    now = 60_000
    up = now - 2 * REBALANCE_AFTER_MS
    assert rebalance(_moved(), _balanced_soft(now, up, commit=10_000, pref_seq=10), now, LEASE) == []  # lagging
    assert rebalance(_moved(), _balanced_soft(now, up), now, LEASE, busy=frozenset({0})) == []
    unready = _moved()
    unready[0].ready_term = 5
    assert rebalance(unready, _balanced_soft(now, up), now, LEASE) == []
    removed = _moved()
    removed[0].voters = ["w2", "w3"]
    assert rebalance(removed, _balanced_soft(now, up), now, LEASE) == []
    silent = _balanced_soft(now, up)
    silent.workers["w2"].last_seen_ms = now - LEASE  # the leader itself went quiet: failover's business
    assert rebalance(_moved(), silent, now, LEASE) == []
    # a new meta leader waits before balancing anything
    fresh = _balanced_soft(now, up)
    fresh.leader_since_ms = now - 1000
    assert rebalance(_moved(), fresh, now, LEASE) == []


def test_one_move_at_a_time_lowest_group_first() -> None:
    now = 60_000
    gs = _moved()
    gs[2].term, gs[2].ready_term, gs[2].leader = 6, 6, "w2"  # group 2 prefers w3
    soft = _balanced_soft(now, now - 2 * REBALANCE_AFTER_MS)
    for wid in ("w2", "w3"):
        reps = dict(soft.workers[wid].groups)
        reps[2] = GroupReport(term=6, last_term=6, last_seq=100, commit=100)
        soft.heard_from(wid, now, reps, LEASE)
    assert rebalance(gs, soft, now, LEASE) == [StartTransfer(group=0, leader="w2", target="w1")]
    assert rebalance(gs, soft, now, LEASE, busy=frozenset({0})) == [StartTransfer(group=2, leader="w2", target="w3")]


# -- an isolated leader (check-quorum) ---------------------------------------------------------


def isolation_soft(now: int, leader_quorum: bool | None = True, silence: dict[str, int | None] | None = None,
                   seen: dict[str, int] | None = None, last: dict[str, tuple[int, int]] | None = None) -> SoftState:
    """Everyone heard from at `now`; group 0 led by w1 (term 5), with w1's
    quorum verdict and the followers' silence on it as given."""
    soft = SoftState(leader_since_ms=0)
    silence = silence or {}
    last = last or {}
    for wid in ("w1", "w2", "w3"):
        role = "leader" if wid == "w1" else "follower"
        t, s = last.get(wid, (5, 100))
        rep = GroupReport(term=5, role=role, last_term=t, last_seq=s, quorum=leader_quorum if wid == "w1" else None,
                          leader_silence_ms=None if wid == "w1" else silence.get(wid, 10))
        soft.heard_from(wid, (seen or {}).get(wid, now), {0: rep})
    return soft


def one_group() -> list[GroupRecord]:
    return [GroupRecord(id=0, term=5, leader="w1", voters=["w1", "w2", "w3"], preferred_leader="w1", ready_term=5)]


def test_a_leader_that_reports_no_quorum_is_failed_over_to_the_most_up_to_date_follower() -> None:
    now = 60_000
    soft = isolation_soft(now, leader_quorum=False, last={"w2": (5, 90), "w3": (5, 99)})
    (action,) = decide(one_group(), soft, now, LEASE)
    assert (action.group, action.leader, action.expect_term, action.cause) == (0, "w3", 5, "isolated")
    assert "reports no round trip with a majority" in action.reason


def test_a_majority_silent_on_a_leader_that_still_claims_its_quorum_fails_it_over() -> None:
    """A wedged leader (its group loop stuck, its heartbeats to meta going on)
    reports a stale verdict; its followers' silence gives it away. The
    silence grows by the age of each report."""
    now = 60_000
    soft = isolation_soft(now, silence={"w2": LEASE - 200, "w3": LEASE}, seen={"w2": now - 200, "w3": now})
    (action,) = decide(one_group(), soft, now, LEASE)
    assert action.cause == "isolated" and "w2, w3 have not heard from leader w1" in action.reason


def test_a_partitioned_follower_changes_nothing() -> None:
    now = 60_000
    soft = isolation_soft(now, silence={"w3": 10 * LEASE})
    assert decide(one_group(), soft, now, LEASE) == []


def test_no_isolation_move_when_the_others_are_no_majority_on_their_own() -> None:
    now = 60_000
    # w3 is silent to meta (dead): w2 alone cannot lead a group of three.
    soft = isolation_soft(now, leader_quorum=False, seen={"w3": now - LEASE - 1})
    assert decide(one_group(), soft, now, LEASE) == []
    # w3 re-syncs: it may not lead or vote either.
    soft = isolation_soft(now, leader_quorum=False)
    soft.workers["w3"].groups[0] = GroupReport(term=5, role="follower", resyncing=True)
    assert decide(one_group(), soft, now, LEASE) == []


def test_reports_from_another_term_are_no_evidence() -> None:
    now = 60_000
    soft = isolation_soft(now, silence={"w2": 10 * LEASE, "w3": 10 * LEASE})
    for wid in ("w2", "w3"):
        rep = soft.workers[wid].groups[0]
        soft.workers[wid].groups[0] = GroupReport(term=4, role="follower", last_term=5, last_seq=100,
                                                  leader_silence_ms=rep.leader_silence_ms)
    assert decide(one_group(), soft, now, LEASE) == []


def test_an_isolation_move_is_held_for_its_decision_window() -> None:
    now = 60_000
    soft = isolation_soft(now, leader_quorum=False)
    soft.isolation_moved_ms[0] = now - ISOLATION_HOLD_LEASES * LEASE + 1
    assert decide(one_group(), soft, now, LEASE) == []
    assert decide(one_group(), soft, now + 1, LEASE)[0].cause == "isolated"


def test_a_new_group_gets_the_bootstrap_grace_before_an_isolation_move() -> None:
    gs = one_group()
    gs[0].ready_term = 0
    soft = isolation_soft(BOOTSTRAP_GRACE_MS - 1, leader_quorum=False)
    assert decide(gs, soft, BOOTSTRAP_GRACE_MS - 1, LEASE) == []
    soft = isolation_soft(BOOTSTRAP_GRACE_MS, leader_quorum=False)
    assert decide(gs, soft, BOOTSTRAP_GRACE_MS, LEASE)[0].cause == "isolated"


def test_balance_leaves_a_group_moved_for_isolation_and_a_preferred_leader_that_cannot_hear() -> None:
    now = 60_000
    gs = one_group()
    gs[0].leader = "w2"
    soft = isolation_soft(now, silence={"w1": 10})
    soft.workers["w1"].groups[0] = GroupReport(term=5, role="follower", last_term=5, last_seq=100,
                                               leader_silence_ms=10)
    soft.workers["w2"].groups[0] = GroupReport(term=5, role="leader", last_term=5, last_seq=100, commit=100,
                                               quorum=True)
    for w in soft.workers.values():
        w.up_since_ms = 0
    assert rebalance(gs, soft, now, LEASE) == [StartTransfer(0, "w2", "w1")]
    soft.isolation_moved_ms[0] = now - REBALANCE_AFTER_MS + 1
    assert rebalance(gs, soft, now, LEASE) == []
    del soft.isolation_moved_ms[0]
    soft.workers["w1"].groups[0] = GroupReport(term=5, role="follower", last_term=5, last_seq=100,
                                               leader_silence_ms=LEASE)
    assert rebalance(gs, soft, now, LEASE) == []


def test_with_five_voters_the_successor_comes_from_the_side_that_cannot_hear_the_leader() -> None:
    """{w1, w4} | {w2, w3, w5}: w4 still hears w1 and holds its newest tail, so the
    most up-to-date voter overall is on the wrong side; leading, it could not
    gather a majority either."""
    now = 60_000
    voters = ["w1", "w2", "w3", "w4", "w5"]
    gs = [GroupRecord(id=0, term=5, leader="w1", voters=voters, preferred_leader="w1", ready_term=5)]
    soft = SoftState(leader_since_ms=0)
    last = {"w1": 130, "w4": 130, "w2": 100, "w3": 101, "w5": 99}
    for wid in voters:
        leads = wid == "w1"
        soft.heard_from(wid, now, {0: GroupReport(term=5, role="leader" if leads else "follower", last_term=5,
                                                  last_seq=last[wid], quorum=False if leads else None,
                                                  leader_silence_ms=None if leads else (5 if wid == "w4" else LEASE))})
    (action,) = decide(gs, soft, now, LEASE)
    assert action.cause == "isolated" and action.leader == "w3"
    # With the leader's own report only (no follower silent), any live voter: the most up-to-date.
    for wid in ("w2", "w3", "w5"):
        rep = soft.workers[wid].groups[0]
        soft.workers[wid].groups[0] = GroupReport(term=5, role="follower", last_term=5, last_seq=rep.last_seq,
                                                  leader_silence_ms=5)
    (action,) = decide(gs, soft, now, LEASE)
    assert action.leader == "w4"
    # ... unless the leader says whom it cannot hear: its report comes first (the
    # followers' silence reaches a lease a moment later), and it names the far side.
    soft.workers["w1"].groups[0] = GroupReport(term=5, role="leader", last_term=5, last_seq=130, quorum=False,
                                               unheard=("w2", "w3", "w5"))
    (action,) = decide(gs, soft, now, LEASE)
    assert action.leader == "w3"


def test_balance_never_hands_a_leadership_back_to_a_worker_on_its_way_out() -> None:
    now = 60_000
    up = now - REBALANCE_AFTER_MS
    assert rebalance(_moved(), _balanced_soft(now, up), now, LEASE) == [StartTransfer(0, "w2", "w1")]
    assert rebalance(_moved(), _balanced_soft(now, up), now, LEASE, unwanted=frozenset({"w1"})) == []


# -- a staged add's catch-up: what its message says -------------------------------------------

def _catching_up(learner: GroupReport) -> list[str]:
    """The message advance_operator gives an add of w4 at catch_up, w4 reporting `learner`."""
    g = GroupRecord(id=0, term=5, leader="w1", voters=["w1", "w2", "w3"], learners=["w4"], ready_term=5)
    soft = SoftState(leader_since_ms=0)
    soft.heard_from("w1", 10_000, {0: GroupReport(term=5, role="leader", commit=5_000, applied=5_000)})
    soft.heard_from("w4", 10_000, {0: learner})
    actions = advance_operator(OperatorRecord(0, "add", "w4", "catch_up"), g, soft, 10_000, LEASE)
    assert all(isinstance(a, UpdateOperator) for a in actions)
    return [f"{a.step}: {a.message}" for a in actions if isinstance(a, UpdateOperator)]


def test_a_learner_receiving_a_snapshot_shows_the_bytes_in_its_operator() -> None:
    assert _catching_up(GroupReport(term=5, role="learner", snapshot_bytes=12_000_000,
                                    snapshot_total=40_000_000)) == \
        ["catch_up: w4 receiving snapshot: 12 MB of 40 MB (30%)"]
    assert _catching_up(GroupReport(term=5, role="learner", snapshot_bytes=0, snapshot_total=40_000_000,
                                    snapshot_waiting=True)) == \
        ["catch_up: w4 waiting for a snapshot download slot (settings.snapshot_concurrency): 0 B of 40 MB (0%)"]
    # No download in flight: the log catch-up, as before.
    assert _catching_up(GroupReport(term=5, role="learner", applied=1_000)) == \
        ["catch_up: w4 catching up: applied 1000 of 5000"]
    # Caught up: promoted, whatever a stale download field says.
    assert _catching_up(GroupReport(term=5, role="learner", applied=4_990, snapshot_bytes=1,
                                    snapshot_total=2)) == ["promote: w4 caught up: applied 4990 of 5000"]


def test_the_snapshot_message_changes_in_5_percent_steps_only() -> None:
    """Each distinct message is a write to meta's Raft log: a download of any
    size and speed makes at most 21 of them, not one per heartbeat."""
    total = 4_000_000_000
    messages = [_catching_up(GroupReport(term=5, role="learner", snapshot_bytes=b, snapshot_total=total))[0]
                for b in range(0, total + 1, 7_000_000)]  # a report every 7 MB: 572 reports
    changes = [b for a, b in zip(messages, messages[1:]) if a != b]
    assert len(changes) == 19  # 0%, 5%, ..., 95%: 20 distinct messages (100% is the installed snapshot)
    assert messages[0].endswith("0 B of 4 GB (0%)") and messages[-1].endswith("3.8 GB of 4 GB (95%)")
    assert snapshot_message("w4", 3_999_999_999, total, False).endswith("(95%)")
    assert snapshot_message("w4", total, total, False).endswith("4 GB of 4 GB (100%)")
    assert snapshot_message("w4", 10, 0, False).endswith("(100%)")  # a zero size does not divide by zero


def test_a_meta_leader_that_stood_still_judges_nobody_on_what_it_heard_before() -> None:
    """Woken from a 1.3 s pause, the meta leader's reports are old: the followers'
    silence, grown by the reports' age, reads as a cut-off leader in every group and
    the leaders as silent. After `stood_still` nobody is judged for a lease."""
    heard, woke = 10_000, 11_300
    soft = SoftState(leader_since_ms=0)
    for wid in ("w1", "w2", "w3"):
        soft.heard_from(wid, heard, {gid: GroupReport(term=5, last_term=5, last_seq=50, commit=50,
                                                      role="leader" if gid == int(wid[1]) - 1 else "follower",
                                                      leader_silence_ms=None if gid == int(wid[1]) - 1 else 300)
                                     for gid in range(3)})
    soft.isolation_moved_ms[1] = heard - 100
    assert {a.group for a in decide(groups(), soft, woke, LEASE)} == {0, 2}  # group 1 is held: isolation window
    soft.stood_still(woke)
    assert decide(groups(), soft, woke, LEASE) == []
    assert decide(groups(), soft, woke + LEASE - 1, LEASE) == []
    assert soft.isolation_moved_ms == {1: heard - 100}  # the decision holds are kept
    # A worker still silent a lease after waking is judged as before.
    soft.heard_from("w2", woke + 200, {0: GroupReport(term=5, last_term=5, last_seq=50)})
    soft.heard_from("w3", woke + 200, {0: GroupReport(term=5, last_term=5, last_seq=50)})
    assert [a.group for a in decide(groups(), soft, woke + LEASE, LEASE)] == [0]
