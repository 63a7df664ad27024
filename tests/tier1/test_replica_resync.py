"""A replica that lost its log (corruption) must not vote or lead until a ready leader re-syncs it."""
from __future__ import annotations

from typing import Any

from tests.tier1.test_replica_unit import Net, op
from worker.replica_msgs import Begin, BeginOk, ClientWrite, MetaView, Reply, Send, StoredState, Tick

VOTERS = ("a", "b", "c")


def sent(effects: list[Any], kind: type) -> list[Any]:
    return [e.msg for e in effects if isinstance(e, Send) and isinstance(e.msg, kind)]


def test_resyncing_replica_never_promises() -> None:
    r = Net({"c": StoredState(term=3, resync=True)}).r["c"]
    r.handle(Begin(src="a", dst="c", group=0, term=4), 1000)
    out = r.handle(MetaView(term=4, leader="a", voters=VOTERS), 1000)  # handles the Begin it kept
    assert sent(out, BeginOk) == [] and r.term == 4  # fenced to the new term, but no promise
    assert r.resyncing


def test_resyncing_replica_refuses_to_lead() -> None:
    r = Net({"c": StoredState(term=3, resync=True)}).r["c"]
    out = r.handle(MetaView(term=4, leader="c", voters=VOTERS), 1000)
    assert sent(out, Begin) == [] and r.role != "leader" and r.term == 4


def _term_2_led_by_a(c: StoredState) -> Net:
    """a and b hold entries 1-3 of term 1; meta names a leader of term 2; `c` re-syncs."""
    log = [op(1, 1), op(1, 2), op(1, 3)]
    net = Net({"a": StoredState(term=1, entries=list(log), commit=3), "b": StoredState(term=1, entries=list(log)),
               "c": c})
    for n in VOTERS:
        net.do(n, MetaView(term=2, leader="a", voters=VOTERS))
    net.run()
    _tick(net, 5)
    return net


def _tick(net: Net, times: int) -> None:
    for _ in range(times):
        net.now += 100
        for n in VOTERS:
            net.do(n, Tick())
        net.run()


def _votes_again(c: Any, now: int) -> bool:
    c.handle(MetaView(term=3, leader="b", voters=VOTERS), now)
    return bool(sent(c.handle(Begin(src="b", dst="c", group=0, term=3), now), BeginOk))


def test_a_ready_leader_brings_it_back_and_it_votes_again() -> None:
    net = _term_2_led_by_a(StoredState(term=1, resync=True))
    assert net.r["a"].ready
    net.do("a", ClientWrite("w1", {"x": 1}, "quorum", "rid-1"))
    net.run()
    _tick(net, 5)
    assert any(isinstance(e, Reply) and e.ok for e in net.effects["a"])
    c = net.r["c"]
    assert c.last_seq == net.r["a"].last_seq and not c.resyncing
    assert _votes_again(c, net.now), "a re-synced replica answers Begin again"


def test_an_idle_group_brings_it_back_without_a_write() -> None:
    """The Append that carried the term-start entry to it carried an older commit;
    the leader's heartbeats carry the newer one: they end the re-sync, not the next
    write (shell simulator seed 1282: an idle group kept a replica out for good)."""
    # c kept entries 1-3 (a snapshot it re-synced from, say): the Append of the
    # term-start entry needs no back-off, so it leaves before that entry commits.
    net = _term_2_led_by_a(StoredState(term=1, entries=[op(1, 1), op(1, 2), op(1, 3)], resync=True))
    _tick(net, 5)
    a, c = net.r["a"], net.r["c"]
    assert a.ready and c.last_seq == a.last_seq == 4 and c.term_at(4) == 2
    assert not c.resyncing and _votes_again(c, net.now)


def test_a_heartbeat_ends_a_re_sync_only_on_the_leaders_own_commit() -> None:
    """`commit` is clamped to the match the leader holds for us, which may be far
    below what we acknowledged before we lost our log (shell simulator seed 1045:
    a re-sync ended on it, and committed entries were lost)."""
    from worker.replica_msgs import Heartbeat

    def replica() -> Any:
        r = Net({"c": StoredState(term=2, entries=[op(1, 1), op(2, 2), op(2, 3)], resync=True)}).r["c"]
        r.handle(MetaView(term=2, leader="a", voters=VOTERS), 1000)
        return r

    def beat(commit: int, leader_commit: int | None) -> Heartbeat:
        return Heartbeat(src="a", dst="c", group=0, term=2, commit=commit, round=1, leader_commit=leader_commit)

    r = replica()
    r.handle(beat(3, None), 1000)  # an older leader sends no leader_commit
    r.handle(beat(3, 9), 1000)  # the leader committed up to 9: we lack 4-9
    assert r.resyncing
    r.handle(beat(1, 1), 1000)  # entry 1 is of term 1: it need not be the leader's
    assert r.resyncing
    r.handle(beat(3, 3), 1000)
    assert not r.resyncing
