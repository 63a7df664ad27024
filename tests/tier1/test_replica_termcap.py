"""The term cap: a replica adopts no term meta has not published.

A message from a term above what meta's views have shown a replica is not
acted on: nothing is persisted, a leader does not step down, and the core
asks its shell for meta's view (NeedMetaView). Once a view shows the term,
the kept message is handled if it came from the leader the view names.
"""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import structlog

from tests.tier1.test_replica_unit import CFG, VOTERS, log_of, op, ready_net, stored
from worker.group import GroupSettings, GroupShell
from tests.support.group_hooks import NullHooks
from worker.plugins.base import load_plugin
from worker.replica import Replica
from worker.replica_msgs import (
    Append,
    AppendReply,
    Begin,
    BeginOk,
    ClientWrite,
    Heartbeat,
    HeartbeatReply,
    MetaView,
    NeedMetaView,
    Persist,
    Send,
    StaleTerm,
)


def _sends(out: list[Any]) -> list[Any]:
    return [e.msg for e in out if isinstance(e, Send)]


def _persists(out: list[Any]) -> list[Persist]:
    return [e for e in out if isinstance(e, Persist)]


def _forged(kind: str, dst: str, term: int, src: str = "mallory") -> Any:
    env = dict(src=src, dst=dst, group=0, term=term)
    if kind == "append":
        return Append(**env, prev_term=1, prev_seq=1, entries=(op(term, 2),), commit=2)
    if kind == "heartbeat":
        return Heartbeat(**env, commit=0, round=0)
    if kind == "begin":
        return Begin(**env)
    return StaleTerm(**env)


def test_a_forged_higher_term_is_not_adopted_by_a_follower() -> None:
    for kind in ("append", "heartbeat", "begin", "stale"):
        net = ready_net()
        b = net.r["b"]
        before = log_of(b)
        out = net.do("b", _forged(kind, "b", 99))
        assert out == [NeedMetaView(99)], kind  # nothing persisted, nothing answered
        assert b.term == 1 and b.leader == "a" and log_of(b) == before


def test_a_forged_higher_term_does_not_unseat_the_leader() -> None:
    for kind in ("append", "heartbeat", "begin", "stale"):
        net = ready_net()
        a = net.r["a"]
        out = net.do("a", _forged(kind, "a", 7, src="b"))
        assert not _persists(out) and NeedMetaView(7) in out, kind
        assert a.ready and a.term == 1
        # ... and it goes on serving
        net.do("a", ClientWrite("w", "x"))
        net.run()
        assert [r for r in net.replies("a") if r.req == "w" and r.ok], kind


def test_the_kept_message_is_handled_once_meta_shows_its_term() -> None:
    r = Replica("b", 0, CFG, stored(1, [op(1, 1)], commit=1))
    app = Append(src="c", dst="b", group=0, term=2, prev_term=1, prev_seq=1, entries=(op(2, 2),), commit=1)
    out = r.handle(app, 10)
    assert NeedMetaView(2) in out and not _persists(out) and not _sends(out)
    out = r.handle(MetaView(2, "c", VOTERS), 20)
    # the term first (before anything is answered at it), then the entries, then the answer
    p = _persists(out)
    assert p and p[0].term == 2 and [e.seq for e in p[-1].entries] == [2]
    reply = [x for x in _sends(out) if isinstance(x, AppendReply)]
    assert reply and reply[0].ok and reply[0].match == 2 and out.index(p[-1]) < out.index(Send(reply[0]))
    assert r.term == 2 and log_of(r) == [(1, 1), (2, 2)]


def test_a_kept_message_from_another_than_meta_s_leader_is_dropped() -> None:
    r = Replica("b", 0, CFG, stored(1, [op(1, 1)], commit=1))
    r.handle(Append(src="mallory", dst="b", group=0, term=2, prev_term=1, prev_seq=1, entries=(op(2, 2),), commit=2),
             10)
    out = r.handle(MetaView(2, "c", VOTERS), 20)
    assert r.term == 2 and log_of(r) == [(1, 1)]  # meta's term, not mallory's entries
    assert not [x for x in _sends(out) if isinstance(x, AppendReply)]


def test_a_far_forged_term_does_not_push_out_the_next_leader_s_message() -> None:
    r = Replica("b", 0, CFG, stored(1, [op(1, 1)], commit=1))
    r.handle(Begin(src="c", dst="b", group=0, term=2), 10)  # the real next leader, ahead of b's view
    r.handle(Begin(src="mallory", dst="b", group=0, term=10**9), 11)
    out = r.handle(MetaView(2, "c", VOTERS), 20)
    assert [x for x in _sends(out) if isinstance(x, BeginOk)] == [
        BeginOk(src="b", dst="c", group=0, term=2, last_term=1, last_seq=1, commit=1)]


def test_the_view_is_asked_for_at_once_per_new_term_else_once_per_retry() -> None:
    net = ready_net()
    asks = []
    for dt, term in ((0, 5), (10, 5), (10, 6), (10, 6), (CFG.retry_ms, 6), (1, 6)):
        net.now += dt
        asks.append(NeedMetaView(term) in net.do("b", _forged("heartbeat", "b", term)))
    assert asks == [True, False, True, False, True, False]


def test_a_new_leader_s_begin_ahead_of_the_view_costs_no_retransmit() -> None:
    net = ready_net()
    # meta names b; only b has the view yet: c keeps b's Begin until its own view comes
    net.do("b", MetaView(2, "b", VOTERS))
    net.drop = lambda msg: msg.dst == "a"  # the old leader is gone
    net.run()
    c = net.r["c"]
    assert c.term == 1 and NeedMetaView(2) in net.effects["c"]
    net.do("c", MetaView(2, "b", VOTERS))
    net.run()  # no tick: nothing is retransmitted
    assert net.r["b"].ready and c.term == 2 and c.leader == "b"


def test_a_restarted_replica_takes_its_own_term_without_a_view() -> None:
    r = Replica("b", 0, CFG, stored(3, [op(3, 1)]))
    out = r.handle(Heartbeat(src="a", dst="b", group=0, term=3, commit=1, round=0), 10)
    assert _sends(out) == [HeartbeatReply(src="b", dst="a", group=0, term=3, round=0)] and r.commit_seq == 1


def test_a_view_that_is_not_there_yet_leaves_the_message_kept() -> None:
    r = Replica("b", 0, CFG, stored(1, [op(1, 1)], commit=1))
    r.handle(Begin(src="c", dst="b", group=0, term=3), 10)
    r.handle(MetaView(2, "a", VOTERS), 20)  # a lagging meta node: term 2 only
    assert r.term == 2
    out = r.handle(MetaView(3, "c", VOTERS), 30)
    assert [x for x in _sends(out) if isinstance(x, BeginOk)]


# ---------------------------------------------------------------------------
# The shell: NeedMetaView becomes one fetch of meta's view at a time


class _MetaHooks(NullHooks):
    """Hooks whose meta answers after `gate` is set, counting the fetches."""

    def __init__(self, view: MetaView) -> None:
        super().__init__()
        self.view = view
        self.fetches = 0
        self.gate = asyncio.Event()

    async def meta_view(self, group: int) -> MetaView | None:
        self.fetches += 1
        await self.gate.wait()
        return self.view


class _Sent:
    def __init__(self) -> None:
        self.msgs: list[Any] = []

    def send(self, msg: Any) -> None:
        self.msgs.append(msg)


async def test_the_shell_fetches_meta_s_view_once_and_the_core_takes_the_kept_message(tmp_path: Path) -> None:
    hooks = _MetaHooks(MetaView(2, "c", VOTERS))
    sent = _Sent()
    g = GroupShell("b", 0, tmp_path, load_plugin("entities"), GroupSettings(fsync="batch", snapshot_every=0),
                   sent, hooks, structlog.get_logger())  # type: ignore[arg-type]
    g.open()
    g.start()
    try:
        g.deliver(MetaView(1, "a", VOTERS))
        for i in range(5):  # a burst from term 2: one fetch in flight
            g.deliver(Begin(src="c", dst="b", group=0, term=2))
            await asyncio.sleep(0.01)
        assert g.replica is not None and g.replica.term == 1 and hooks.fetches == 1
        assert not [x for x in sent.msgs if isinstance(x, BeginOk)]
        hooks.gate.set()
        for _ in range(200):
            if [x for x in sent.msgs if isinstance(x, BeginOk)]:
                break
            await asyncio.sleep(0.01)
        assert [x for x in sent.msgs if isinstance(x, BeginOk) and x.term == 2]
        assert g.replica.term == 2 and g.wal is not None and g.failed is None
    finally:
        await g.close()
