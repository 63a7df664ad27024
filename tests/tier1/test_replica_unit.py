"""Unit tests of the concrete protocol steps of worker/replica.py.

A tiny synchronous harness delivers messages FIFO until quiet; tests poke
at the exact messages where the protocol step under test happens.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from shardgrid.common.wire import packb
from worker.codec import encode_entry
from worker.dedup import DedupTable
from worker.replica import _TRANSITIONS, Replica, _Begin, _Fetch, _Leadership, _Ready, _Starting
from worker.replica_msgs import (
    Append,
    AppendReply,
    Apply,
    Begin,
    BeginOk,
    ChangeMembership,
    ClientRead,
    ClientWrite,
    ClientWriteMany,
    Compact,
    Config,
    DownloadSnapshot,
    Entry,
    Fetch,
    FetchReply,
    Heartbeat,
    HeartbeatReply,
    Message,
    MetaView,
    NO_QUORUM,
    NeedMetaView,
    Persist,
    ReplicaConfig,
    Reply,
    ReplyMany,
    ReportQuorum,
    ReportReady,
    Send,
    ServeRead,
    SnapshotInstalled,
    SnapshotNeeded,
    StaleTerm,
    StoredState,
    TakeSnapshot,
    Tick,
    TransferLeader,
    TransferReady,
)

CFG = ReplicaConfig()


def op(term: int, seq: int, data: Any = None, rid: str | None = None) -> Entry:
    return Entry(term, seq, "op", data if data is not None else f"v{term}.{seq}", rid, 0)


class Net:
    """Replicas plus a FIFO of in-flight messages; records every effect."""

    def __init__(self, stored: dict[str, StoredState], cfg: ReplicaConfig = CFG) -> None:
        self.r = {n: Replica(n, 0, cfg, s) for n, s in stored.items()}
        self.queue: list[Message] = []
        self.effects: dict[str, list[Any]] = {n: [] for n in stored}
        self.now = 1000
        self.drop: Callable[[Message], bool] = lambda m: False

    def do(self, node: str, ev: Any) -> list[Any]:
        out = self.r[node].handle(ev, self.now)
        self.effects[node].extend(out)
        for e in out:
            if isinstance(e, Send):
                self.queue.append(e.msg)
        return out

    def run(self, limit: int = 10_000) -> None:
        while self.queue and limit:
            limit -= 1
            m = self.queue.pop(0)
            if self.drop(m) or m.dst not in self.r:
                continue
            self.do(m.dst, m)

    def view(self, term: int, leader: str, voters: tuple[str, ...], learners: tuple[str, ...] = (), conf_ver: int = 0) -> None:
        v = MetaView(term, leader, voters, learners, conf_ver)
        for n in self.r:
            self.do(n, v)

    def tick(self, ms: int) -> None:
        self.now += ms
        for n in self.r:
            self.do(n, Tick())

    def of(self, node: str, kind: type) -> list[Any]:
        return [e for e in self.effects[node] if isinstance(e, kind)]

    def replies(self, node: str) -> list[Reply]:
        """Every Reply, with each ReplyMany as the Replies it stands for."""
        out: list[Reply] = []
        for e in self.effects[node]:
            if isinstance(e, Reply):
                out.append(e)
            elif isinstance(e, ReplyMany):
                out.extend(Reply(req, True, e.seq, e.term, None, e.leader, i) for i, req in enumerate(e.reqs))
        return out

    def sent(self, kind: type) -> list[Any]:
        return [m for effs in self.effects.values() for e in effs if isinstance(e, Send) for m in [e.msg] if isinstance(m, kind)]


def log_of(r: Replica) -> list[tuple[int, int]]:
    return [(e.term, e.seq) for e in r.entries(1, r.last_seq)]


def stored(term: int, entries: list[Entry], commit: int = 0) -> StoredState:
    return StoredState(term=term, entries=list(entries), commit=commit)


VOTERS = ("a", "b", "c")


def ready_net(n: int = 3, cfg: ReplicaConfig = CFG) -> Net:
    names = tuple("abcde"[:n])
    net = Net({x: StoredState() for x in names}, cfg)
    net.view(1, "a", names)
    net.run()
    assert net.r["a"].ready
    return net


# ---------------------------------------------------------------------------
# Start of term


def test_new_group_becomes_ready_and_reports() -> None:
    net = ready_net()
    a = net.r["a"]
    assert a.role == "leader" and a.term == 1
    assert net.of("a", ReportReady) == [ReportReady(1)]
    assert a.commit_seq == 1 and log_of(a) == [(1, 1)]
    # the term is persisted before Begin goes out
    effs = net.effects["a"]
    first_persist = next(i for i, e in enumerate(effs) if isinstance(e, Persist) and e.term == 1)
    first_begin = next(i for i, e in enumerate(effs) if isinstance(e, Send) and isinstance(e.msg, Begin))
    assert first_persist < first_begin


def test_begin_ok_follows_persisted_term() -> None:
    r = Replica("b", 0, CFG, stored(1, [op(1, 1)]))
    # Term 2 is not meta's yet as far as b knows: kept until the view shows it.
    out = r.handle(Begin(src="a", dst="b", group=0, term=2), 5)
    assert out == [NeedMetaView(2)] and r.term == 1
    out = r.handle(MetaView(2, "a", VOTERS), 5)
    assert isinstance(out[0], Persist) and out[0].term == 2
    ok = [e.msg for e in out if isinstance(e, Send) and isinstance(e.msg, BeginOk)][0]
    assert (ok.last_term, ok.last_seq) == (1, 1)
    # from now on, term 1 is rejected
    out = r.handle(Append(src="x", dst="b", group=0, term=1, prev_term=1, prev_seq=1, entries=(op(1, 2),), commit=0), 6)
    assert isinstance(out[0].msg, StaleTerm) and out[0].msg.term == 2
    assert r.last_seq == 1


def test_begin_adopts_greatest_last_term_then_seq() -> None:
    # a is stale; b has the longest log; c has the greatest last term.
    net = Net(
        {
            "a": stored(3, [op(1, 1), op(1, 2)], commit=1),
            "b": stored(3, [op(1, 1), op(1, 2), op(2, 3), op(2, 4), op(2, 5)], commit=1),
            "c": stored(3, [op(1, 1), op(1, 2), op(2, 3), op(3, 4)], commit=1),
        }
    )
    # b's promise arrives after c's: the majority {a, c} decides
    net.drop = lambda m: isinstance(m, Begin) and m.dst == "b"
    net.view(4, "a", VOTERS)
    net.run()
    a = net.r["a"]
    assert a.ready
    fetches = net.sent(Fetch)
    assert fetches and all(f.dst == "c" for f in fetches)
    assert log_of(a) == [(1, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    # b's uncommitted (2,4),(2,5) are cut in favour of the adopted log
    assert log_of(net.r["b"]) == log_of(a)


def test_a_fetch_source_that_lost_its_log_voids_its_promise_and_begin_is_asked_again() -> None:
    # c promised the best log, then came back from a replaced disk: its answer
    # contradicts what a knows is committed. a must ask for promises again, not crash.
    net = Net(
        {
            "a": stored(3, [op(1, 1), op(1, 2)], commit=2),
            "b": stored(3, [op(1, 1), op(1, 2)], commit=2),
            "c": stored(3, [op(1, 1), op(1, 2), op(3, 3)], commit=2),
        }
    )
    net.drop = lambda m: isinstance(m, (Begin, Fetch)) and m.dst == "b" or isinstance(m, Fetch)
    net.view(4, "a", VOTERS)
    net.run()
    [fetch] = [f for f in net.sent(Fetch) if f.dst == "c"]
    begins_before = len([b for b in net.sent(Begin) if b.dst == "b"])
    out = net.do("a", FetchReply(src="c", dst="a", group=0, term=4, ok=False, prev_seq=fetch.prev_seq,
                                 prev_term=fetch.prev_term, hint_seq=0, hint_term=0))
    assert [m.msg.dst for m in out if isinstance(m, Send) and isinstance(m.msg, Begin)] == ["b", "c"]
    assert len([b for b in net.sent(Begin) if b.dst == "b"]) == begins_before + 1
    # b (whose promise is now what counts) and a form the majority: a leads with the log they hold
    net.drop = lambda m: m.dst == "c"
    net.tick(300)
    net.run()
    assert net.r["a"].ready and log_of(net.r["a"])[:2] == [(1, 1), (1, 2)]


def test_leadership_phases_change_only_along_the_transition_table() -> None:
    lead = _Leadership(quorums=(("a", "b", "c"),), begin_to=("b", "c"), started_at=0)
    assert isinstance(lead.phase, _Begin)
    with pytest.raises(AttributeError):
        lead.phase.src  # type: ignore[attr-defined]  # a fetch's field does not exist before the fetch
    lead.enter(_Fetch(src="c", goal=(3, 3), prev=2, heard_at=0))
    lead.enter(_Begin())  # the fetch failed: promises again
    with pytest.raises(AssertionError):
        lead.enter(_Ready())  # nothing committed the term start
    lead.enter(_Starting(term_start_seq=3))
    for bad in (_Begin(), _Fetch(src="c", goal=(3, 3), prev=2, heard_at=0), _Starting(term_start_seq=4)):
        with pytest.raises(AssertionError):
            lead.enter(bad)
    lead.enter(_Ready())
    assert lead.ready and _TRANSITIONS[_Ready] == frozenset()


def test_begin_adopts_greatest_seq_on_equal_last_term() -> None:
    net = Net(
        {
            "a": stored(3, [op(1, 1), op(2, 2)], commit=1),
            "b": stored(3, [op(1, 1), op(2, 2), op(2, 3), op(2, 4)], commit=1),
            "c": stored(3, [op(1, 1), op(2, 2), op(2, 3)], commit=1),
        }
    )
    net.view(4, "a", VOTERS)
    net.run()
    a = net.r["a"]
    assert a.ready and [f.dst for f in net.sent(Fetch)] == ["b"]
    assert log_of(a) == [(1, 1), (2, 2), (2, 3), (2, 4), (4, 5)]


def test_begin_majority_only_adopts_among_responders() -> None:
    net = Net(
        {
            "a": stored(1, [op(1, 1)]),
            "b": stored(1, [op(1, 1)]),
            "c": stored(1, [op(1, 1), op(1, 2), op(1, 3)]),
        }
    )
    net.drop = lambda m: m.dst == "c" or m.src == "c"
    net.view(2, "a", VOTERS)
    net.run()
    a = net.r["a"]
    assert a.ready and log_of(a) == [(1, 1), (2, 2)]  # c's tail was never acknowledged
    net.drop = lambda m: False
    net.tick(CFG.retry_ms)
    net.run()
    net.tick(CFG.heartbeat_ms)
    net.run()
    assert log_of(net.r["c"]) == [(1, 1), (2, 2)]


def test_no_quorum_no_progress_and_begin_is_retried() -> None:
    net = Net({x: StoredState() for x in VOTERS})
    net.drop = lambda m: m.dst != "a"
    net.view(1, "a", VOTERS)
    net.run()
    assert net.r["a"].role == "candidate" and not net.r["a"].ready
    assert len(net.sent(Begin)) == 2
    net.tick(CFG.retry_ms)
    assert len(net.sent(Begin)) == 4
    net.drop = lambda m: False
    net.run()
    assert net.r["a"].ready


def test_restarted_leader_does_not_resume_its_term() -> None:
    net = ready_net()
    a2 = Replica("a", 0, CFG, stored(1, [Entry(1, 1, "term_start")], commit=1))
    out = a2.handle(MetaView(1, "a", VOTERS), 5000)
    assert a2.role == "follower" and not any(isinstance(e, Send) for e in out)


def test_stale_leader_steps_down_on_higher_term() -> None:
    net = ready_net()
    net.view(2, "b", VOTERS)
    net.run()
    assert net.r["b"].ready and net.r["a"].role == "follower" and net.r["a"].leader == "b"
    out = net.do("a", ClientWrite("w", "x"))
    assert out[0] == Reply("w", False, 0, 2, "not_leader", "b")


def test_write_pending_when_leader_steps_down_gets_quorum_timeout() -> None:
    net = ready_net()
    net.drop = lambda m: True
    net.do("a", ClientWrite("w", "x"))
    out = net.do("a", StaleTerm(src="b", dst="a", group=0, term=5))
    # Meta's view decides, not the message: a asks for it and leads on meanwhile.
    assert out == [NeedMetaView(5)] and net.r["a"].term == 1 and net.r["a"].ready
    out = net.do("a", MetaView(5, "b", VOTERS))
    assert Reply("w", False, 0, 1, "quorum_timeout", "b") in out
    assert net.r["a"].term == 5 and net.r["a"].role == "follower"


def test_meta_naming_a_non_voter_is_refused() -> None:
    r = Replica("d", 0, CFG, StoredState())
    out = r.handle(MetaView(3, "d", VOTERS), 1)
    assert r.role == "follower" and r.term == 3 and not any(isinstance(e, Send) for e in out)


# ---------------------------------------------------------------------------
# Log matching and truncation


def test_conflicting_suffix_is_truncated_by_term_and_seq() -> None:
    r = Replica("b", 0, CFG, stored(2, [op(1, 1), op(2, 2), op(2, 3)], commit=1))
    r.handle(MetaView(3, "a", VOTERS), 10)
    out = r.handle(
        Append(src="a", dst="b", group=0, term=3, prev_term=1, prev_seq=1, entries=(op(3, 2), op(3, 3), op(3, 4)), commit=1),
        10,
    )
    p = [e for e in out if isinstance(e, Persist)]
    assert len(p) == 1 and p[0].truncate_after == 1 and [e.seq for e in p[0].entries] == [2, 3, 4]
    assert log_of(r) == [(1, 1), (3, 2), (3, 3), (3, 4)]
    reply = [e.msg for e in out if isinstance(e, Send)][0]
    assert isinstance(reply, AppendReply) and reply.ok and reply.match == 4
    # the reply comes after the Persist that makes it true
    assert out.index(p[0]) < [i for i, e in enumerate(out) if isinstance(e, Send)][0]


def test_matching_prefix_is_kept_and_stale_duplicate_is_harmless() -> None:
    r = Replica("b", 0, CFG, stored(3, [op(1, 1), op(3, 2), op(3, 3)]))
    out = r.handle(Append(src="a", dst="b", group=0, term=3, prev_term=1, prev_seq=1, entries=(op(3, 2),), commit=0), 10)
    assert not any(isinstance(e, Persist) for e in out)
    assert log_of(r) == [(1, 1), (3, 2), (3, 3)]  # the shorter duplicate does not cut the tail
    assert out[-1].msg.match == 2


def test_prev_mismatch_hint_skips_a_whole_term() -> None:
    r = Replica("b", 0, CFG, stored(2, [op(1, 1), op(2, 2), op(2, 3), op(2, 4)]))
    r.handle(MetaView(3, "a", VOTERS), 10)
    out = r.handle(Append(src="a", dst="b", group=0, term=3, prev_term=3, prev_seq=4, entries=(), commit=0), 10)
    rep = [e.msg for e in out if isinstance(e, Send)][0]
    # etcd's findConflictByTerm: the follower names its last entry whose
    # term is <= prev_term; the leader then skips its own entries of
    # terms > 2 the same way.
    assert not rep.ok and (rep.hint_seq, rep.hint_term) == (4, 2)
    out = r.handle(Append(src="a", dst="b", group=0, term=3, prev_term=1, prev_seq=9, entries=(), commit=0), 11)
    rep = [e.msg for e in out if isinstance(e, Send)][0]
    assert not rep.ok and (rep.hint_seq, rep.hint_term) == (4, 2)


def test_leader_backs_up_quickly_to_repair_a_divergent_follower() -> None:
    long_tail = [op(1, 1)] + [op(2, s) for s in range(2, 40)]
    net = Net({"a": stored(3, [op(1, 1), op(3, 2)], commit=1), "b": stored(3, [op(1, 1), op(3, 2)], commit=1), "c": stored(2, long_tail, commit=1)})
    net.drop = lambda m: m.dst == "c" and isinstance(m, Begin)
    net.view(4, "a", VOTERS)
    net.run()
    assert log_of(net.r["c"]) == log_of(net.r["a"])
    assert len([m for m in net.sent(Append) if m.dst == "c"]) <= 3


def test_truncating_a_committed_entry_is_an_assertion() -> None:
    r = Replica("b", 0, CFG, stored(2, [op(1, 1), op(2, 2)], commit=2))
    r.handle(MetaView(3, "a", VOTERS), 10)
    with pytest.raises(AssertionError):
        r.handle(Append(src="a", dst="b", group=0, term=3, prev_term=1, prev_seq=1, entries=(op(3, 2),), commit=0), 10)


def test_follower_commit_is_bounded_by_what_the_append_vouched_for() -> None:
    r = Replica("b", 0, CFG, stored(1, [op(1, 1), op(1, 2), op(1, 3)]))
    r.handle(MetaView(2, "a", VOTERS), 10)
    r.handle(Append(src="a", dst="b", group=0, term=2, prev_term=1, prev_seq=1, entries=(), commit=3), 10)
    assert r.commit_seq == 1


# ---------------------------------------------------------------------------
# Commit rule


def test_previous_term_entries_commit_only_with_the_term_start() -> None:
    net = Net({"a": stored(1, [op(1, 1), op(1, 2)]), "b": stored(1, [op(1, 1)]), "c": stored(1, [op(1, 1)])}, ReplicaConfig(max_batch_entries=1))
    held: list[Message] = []

    def hold(m: Message) -> bool:
        # b's acknowledgements of anything past seq 2 are held back
        if isinstance(m, AppendReply) and m.src == "b" and m.match > 2:
            held.append(m)
            return True
        return isinstance(m, (AppendReply, Append)) and "c" in (m.src, m.dst)

    net.drop = hold
    net.view(2, "a", VOTERS)
    net.run()
    a = net.r["a"]
    # a majority (a, b) durably holds (1, 2), yet it is not committed: only
    # an entry of term 2 can be committed by counting.
    assert net.r["b"].last_seq >= 2 and a.commit_seq == 0 and not a.ready
    net.drop = lambda m: False
    for m in held:
        net.do("a", m)
    net.run()
    assert a.ready and a.commit_seq == 3
    applied = [e.seq for x in net.of("a", Apply) for e in x.entries]
    assert applied == [1, 2, 3]


def test_learners_never_count() -> None:
    net = Net({x: StoredState() for x in ("a", "b", "c", "l")})
    net.drop = lambda m: m.dst in ("b", "c") or m.src in ("b", "c")
    net.view(1, "a", VOTERS, ("l",))
    net.run()
    assert not net.r["a"].ready  # Begin cannot even finish without b or c


def test_single_voter_commits_alone() -> None:
    net = Net({"a": StoredState()})
    net.view(1, "a", ("a",))
    net.run()
    out = net.do("a", ClientWrite("w", "x", rid="r1"))
    assert Reply("w", True, 2, 1, None, "a") in out


# ---------------------------------------------------------------------------
# Writes, dedup and ack modes


def test_quorum_write_is_replied_after_commit_and_apply() -> None:
    net = ready_net()
    net.do("a", ClientWrite("w", "x", rid="r1"))
    assert not net.of("a", Reply)
    net.run()
    effs = net.effects["a"]
    i_apply = max(i for i, e in enumerate(effs) if isinstance(e, Apply))
    i_reply = next(i for i, e in enumerate(effs) if isinstance(e, Reply))
    assert effs[i_reply] == Reply("w", True, 2, 1, None, "a") and i_apply < i_reply


def test_retried_rid_is_deduplicated() -> None:
    net = ready_net()
    net.do("a", ClientWrite("w1", "x", rid="r1"))
    net.do("a", ClientWrite("w2", "x", rid="r1"))  # pending: attached
    net.run()
    replies = net.of("a", Reply)
    assert replies == [Reply("w1", True, 2, 1, None, "a"), Reply("w2", True, 2, 1, None, "a")]
    out = net.do("a", ClientWrite("w3", "x", rid="r1"))  # committed: answered at once
    assert out[0] == Reply("w3", True, 2, 1, None, "a") and net.r["a"].last_seq == 2
    # another leader knows it too: the table is derived from the log
    net.view(2, "b", VOTERS)
    net.run()
    out = net.do("b", ClientWrite("w4", "x", rid="r1"))
    assert out[0] == Reply("w4", True, 2, 2, None, "b")
    rids = [e.rid for e in net.r["b"].entries(1, 99)]
    assert rids.count("r1") == 1


def test_writes_submitted_together_share_one_ops_entry_and_keep_their_rids() -> None:
    net = ready_net()
    net.do("a", ClientWrite("w0", "x", rid="r0"))
    net.run()
    # r0 is already applied, r2 appears twice, r3 has no rid: one new entry for r1, r2 and the rid-less op
    net.do("a", ClientWriteMany(("m0", "m1", "m2", "m3", "m4"), ("x", "y", "z", "z", "q"), "quorum",
                                ("r0", "r1", "r2", "r2", None)))
    net.run()
    entries = net.r["b"].entries(1, 99)
    assert [e.kind for e in entries] == ["term_start", "op", "ops"]
    assert entries[2].data == ("y", "z", "q") and entries[2].rid == ("r1", "r2", None)
    replies = {r.req: r for r in net.replies("a")}
    assert replies["m0"] == Reply("m0", True, 2, 1, None, "a")  # answered from the dedup table
    assert [(replies[k].seq, replies[k].idx) for k in ("m1", "m2", "m3", "m4")] == [(3, 0), (3, 1), (3, 1), (3, 2)]
    # the fresh writes, in entry order, are answered by one effect; the repeated rid by its own Reply
    assert net.of("a", ReplyMany) == [ReplyMany(("m1", "m2", "m4"), 3, 1, "a")]
    # each rid of the ops entry is remembered, here and on a new leader
    out = net.do("a", ClientWrite("again", "y", rid="r1"))
    assert out[0] == Reply("again", True, 3, 1, None, "a", 0) and net.r["a"].last_seq == 3  # its place in the entry
    net.view(2, "b", VOTERS)
    net.run()
    out = net.do("b", ClientWriteMany(("b1", "b2"), ("z", "new"), "quorum", ("r2", "r9")))
    net.run()
    replies = {r.req: r for r in net.replies("b")}
    assert replies["b1"].seq == 3 and replies["b2"].seq == net.r["b"].last_seq > 3
    assert net.r["b"].entries(net.r["b"].last_seq, net.r["b"].last_seq)[0].kind == "op"  # one fresh write: a plain op


def test_appends_to_a_lagging_follower_are_bounded_in_writes() -> None:
    net = ready_net(cfg=ReplicaConfig(max_batch_ops=10))
    net.drop = lambda m: m.dst == "c"
    for b in range(5):
        reqs = tuple(f"b{b}-{i}" for i in range(4))
        net.do("a", ClientWriteMany(reqs, tuple(range(4)), "quorum", reqs))
        net.run()
    net.drop = lambda m: False
    net.tick(1000)
    net.run()
    assert net.r["c"].last_seq == net.r["a"].last_seq
    sizes = [sum(len(e.data) if e.kind == "ops" else 1 for e in a.entries) for a in net.sent(Append) if a.dst == "c"]
    assert max(sizes) <= 10 and sum(sizes) >= 20  # never more than max_batch_ops writes in one Append


def _weight(op: Any) -> int:
    """A bulk op in these tests: ("bulk", n) stands for n client writes."""
    return op[1] if isinstance(op, tuple) and op[0] == "bulk" else 1


def test_appends_to_a_lagging_follower_are_bounded_by_op_weight() -> None:
    net = ready_net(cfg=ReplicaConfig(max_batch_ops=10, op_weight=_weight))
    net.drop = lambda m: m.dst == "c"
    for b in range(6):
        net.do("a", ClientWrite(f"w{b}", ("bulk", 4), rid=f"r{b}"))
        net.run()
    net.drop = lambda m: False
    net.tick(1000)
    net.run()
    assert net.r["c"].last_seq == net.r["a"].last_seq
    sizes = [sum(_weight(e.data) for e in a.entries if e.kind == "op") for a in net.sent(Append) if a.dst == "c"]
    # Counted as entries, all six bulk ops would fit one Append; by weight, two per Append.
    assert max(sizes) == 8 and sum(sizes) >= 24  # (sent counts the dropped tries too)


def test_a_bulk_op_alone_over_the_bound_still_goes() -> None:
    net = ready_net(cfg=ReplicaConfig(max_batch_ops=10, op_weight=_weight))
    net.drop = lambda m: m.dst == "c"
    net.do("a", ClientWrite("w", ("bulk", 50), rid="r"))
    net.run()
    net.drop = lambda m: False
    net.tick(1000)
    net.run()
    assert net.r["c"].last_seq == net.r["a"].last_seq  # the first entry goes even when it alone is over


def _encoded(e: Entry) -> int:
    return len(packb(encode_entry(e)))


def test_appends_to_a_lagging_follower_are_bounded_in_bytes() -> None:
    # Entries of about 300 bytes and a 1000-byte bound: three per Append; one of
    # 5000 bytes, over the bound alone, still goes, by itself.
    net = ready_net(cfg=ReplicaConfig(max_batch_bytes=1000, entry_bytes=_encoded))
    net.drop = lambda m: m.dst == "c"
    for b in range(9):
        net.do("a", ClientWrite(f"w{b}", "x" * 280, rid=f"r{b}"))
        net.run()
    net.do("a", ClientWrite("big", "y" * 5000, rid="rbig"))
    net.run()
    net.do("a", ClientWrite("after", "z" * 280, rid="rafter"))
    net.run()
    net.drop = lambda m: False
    net.tick(1000)
    net.run()
    assert net.r["c"].last_seq == net.r["a"].last_seq
    appends = [a for a in net.sent(Append) if a.dst == "c" and a.entries]
    for a in appends:
        size = sum(map(_encoded, a.entries))
        assert size <= 1000 or len(a.entries) == 1, (size, len(a.entries))
    assert max(len(a.entries) for a in appends) == 3
    assert any(len(a.entries) == 1 and _encoded(a.entries[0]) > 5000 for a in appends)


def test_appends_are_not_measured_without_a_sizer_or_for_a_lone_entry() -> None:
    measured: list[int] = []

    def size(e: Entry) -> int:
        measured.append(e.seq)
        return _encoded(e)

    net = ready_net(cfg=ReplicaConfig(max_batch_bytes=1000, entry_bytes=size))
    measured.clear()
    net.do("a", ClientWrite("w", "x" * 5000, rid="r"))  # each follower's Append carries it alone
    net.run()
    assert measured == [] and net.r["c"].last_seq == net.r["a"].last_seq


def test_snapshot_points_count_op_weight() -> None:
    net = ready_net(cfg=ReplicaConfig(snapshot_every=10, op_weight=_weight))
    for i, n in enumerate((3, 6, 1, 2)):  # seqs 2..5: 3, 9, 10 (a point), 2
        net.do("a", ClientWrite(f"w{i}", ("bulk", n), rid=f"r{i}"))
        net.run()
    net.tick(CFG.heartbeat_ms)
    net.run()
    assert [t.seq for t in net.of("a", TakeSnapshot)] == [4]
    many = ClientWriteMany(("m1", "m2"), (("bulk", 4), ("bulk", 4)), "quorum", ("q1", "q2"))
    net.do("a", many)  # one "ops" entry at seq 6 of weight 8: 2 + 8 = 10
    net.run()
    net.tick(CFG.heartbeat_ms)
    net.run()
    assert [t.seq for t in net.of("a", TakeSnapshot)] == [4, 6]


def test_writes_submitted_together_are_refused_together_off_leader() -> None:
    net = ready_net()
    out = net.do("b", ClientWriteMany(("x1", "x2"), ("a", "b"), "quorum", ("q1", "q2")))
    assert [(r.req, r.error_code, r.leader) for r in out if isinstance(r, Reply)] == [
        ("x1", "not_leader", "a"), ("x2", "not_leader", "a")]


def test_pending_rid_survives_leader_change_and_commits_once() -> None:
    net = ready_net()
    net.drop = lambda m: m.dst == "c" or isinstance(m, AppendReply)
    net.do("a", ClientWrite("w1", "x", rid="r1"))  # reaches b only, never acknowledged
    net.run()
    assert net.r["b"].last_seq == 2 and net.r["a"].commit_seq == 1
    net.drop = lambda m: False
    net.view(2, "c", VOTERS)
    net.run()
    c = net.r["c"]
    assert c.ready
    out = net.do("c", ClientWrite("w2", "x", rid="r1"))
    assert out[0] == Reply("w2", True, 2, 2, None, "c")
    assert [e.rid for e in c.entries(1, 99)].count("r1") == 1


def test_ack_leader_replies_after_persist_before_commit() -> None:
    net = ready_net()
    out = net.do("a", ClientWrite("w", "x", ack="leader"))
    kinds = [type(e).__name__ for e in out]
    assert kinds.index("Persist") < kinds.index("Reply")
    assert net.r["a"].commit_seq == 1


def test_ack_all_waits_for_every_voter() -> None:
    net = ready_net()
    net.drop = lambda m: m.dst == "c"
    net.do("a", ClientWrite("w", "x", ack="all"))
    net.run()
    assert net.r["a"].commit_seq == 2 and not net.of("a", Reply)
    net.drop = lambda m: False
    net.tick(CFG.retry_ms)
    net.run()
    assert net.of("a", Reply) == [Reply("w", True, 2, 1, None, "a")]


def test_quorum_timeout() -> None:
    # (A lease longer than the timeout: this is about the timeout, not check-quorum.)
    net = ready_net(cfg=ReplicaConfig(lease_ms=CFG.quorum_timeout_ms * 10))
    net.drop = lambda m: m.src != "a"
    net.do("a", ClientWrite("w", "x"))
    net.run()
    net.tick(CFG.quorum_timeout_ms - 1)
    assert not net.of("a", Reply)
    net.tick(1)
    assert net.of("a", Reply) == [Reply("w", False, 0, 1, "quorum_timeout", "a")]


def test_a_batch_waits_as_one_and_fails_write_by_write() -> None:
    reqs, rids = ("m0", "m1", "m2"), ("r0", "r1", "r2")
    # ack=leader: answered as soon as the entry is persisted, one effect for the batch
    net = ready_net()
    out = net.do("a", ClientWriteMany(reqs, ("x", "y", "z"), "leader", rids))
    kinds = [type(e).__name__ for e in out]
    assert kinds.index("Persist") < kinds.index("ReplyMany") and net.of("a", Reply) == []
    assert net.of("a", ReplyMany) == [ReplyMany(reqs, 2, 1, "a")]
    # ack=all: not before the last voter has it
    net = ready_net()
    net.drop = lambda m: m.dst == "c"
    net.do("a", ClientWriteMany(reqs, ("x", "y", "z"), "all", rids))
    net.run()
    assert net.r["a"].commit_seq == 2 and net.replies("a") == []
    net.drop = lambda m: False
    net.tick(CFG.retry_ms)
    net.run()
    assert net.of("a", ReplyMany) == [ReplyMany(reqs, 2, 1, "a")]
    # no quorum: each write of the batch times out on its own
    net = ready_net()
    net.drop = lambda m: m.src != "a"
    net.do("a", ClientWriteMany(reqs, ("x", "y", "z"), "quorum", rids))
    net.run()
    net.tick(CFG.quorum_timeout_ms)
    assert net.replies("a") == [Reply(q, False, 0, 1, "quorum_timeout", "a") for q in reqs]
    # the leader steps down with a batch pending: each write gets an unknown outcome
    net = ready_net()
    net.drop = lambda m: True
    net.do("a", ClientWriteMany(reqs, ("x", "y", "z"), "quorum", rids))
    net.do("a", StaleTerm(src="b", dst="a", group=0, term=5))
    out = net.do("a", MetaView(5, "b", VOTERS))
    assert [e for e in out if isinstance(e, Reply)] == [Reply(q, False, 0, 1, "quorum_timeout", "b") for q in reqs]


def test_not_leader_carries_hint() -> None:
    net = ready_net()
    out = net.do("b", ClientWrite("w", "x"))
    assert out[0] == Reply("w", False, 0, 1, "not_leader", "a")


def test_pipelining_one_append_in_flight_then_batch() -> None:
    net = ready_net()
    for i in range(5):
        net.do("a", ClientWrite(f"w{i}", i))
    appends = [m for m in net.sent(Append) if m.dst == "b" and m.entries and m.entries[0].kind == "op"]
    assert len(appends) == 1 and len(appends[0].entries) == 1
    net.run()
    appends = [m for m in net.sent(Append) if m.dst == "b" and m.entries and m.entries[0].kind == "op"]
    assert [len(m.entries) for m in appends] == [1, 4]
    assert len(net.of("a", Reply)) == 5


def test_lost_append_is_retransmitted() -> None:
    net = ready_net()
    net.drop = lambda m: isinstance(m, Append)
    net.do("a", ClientWrite("w", "x"))
    net.run()
    net.drop = lambda m: False
    net.tick(CFG.retry_ms)
    net.run()
    assert net.of("a", Reply) == [Reply("w", True, 2, 1, None, "a")]


def test_heartbeat_carries_commit_to_followers() -> None:
    net = ready_net(cfg=ReplicaConfig(commit_notice_ms=10_000))  # only the periodic heartbeat
    net.do("a", ClientWrite("w", "x"))
    net.run()
    assert net.r["b"].commit_seq == 1
    net.tick(CFG.heartbeat_ms)
    net.run()
    assert net.r["b"].commit_seq == 2 and net.r["b"].applied_seq == 2


def test_the_last_commit_of_a_burst_reaches_followers_as_a_notice_long_before_a_heartbeat() -> None:
    net = ready_net()
    net.do("a", ClientWrite("w", "x"))
    net.run()
    assert net.r["a"].commit_seq == 2 and net.r["b"].commit_seq == 1
    before = len(net.sent(Heartbeat))
    net.tick(CFG.commit_notice_ms - 1)
    net.run()
    assert net.r["b"].commit_seq == 1 and len(net.sent(Heartbeat)) == before
    net.tick(1)
    net.run()
    assert CFG.commit_notice_ms < CFG.heartbeat_ms
    assert [(h.dst, h.commit) for h in net.sent(Heartbeat)[before:]] == [("b", 2), ("c", 2)]
    assert all(net.r[x].commit_seq == 2 and net.r[x].applied_seq == 2 for x in ("b", "c"))
    # Told once: nothing more until the periodic heartbeat.
    net.tick(CFG.commit_notice_ms)
    net.run()
    assert len(net.sent(Heartbeat)) == before + 2


def test_no_commit_notice_to_a_follower_with_an_append_in_flight() -> None:
    """b's reply to seq 2 completes the quorum, but the Append of seq 3 it triggers left
    before the commit moved: b lags our commit with that Append still in flight."""
    net = ready_net()
    net.drop = lambda m: isinstance(m, Append) and m.dst == "b" and m.prev_seq == 2  # lost
    net.do("a", ClientWrite("w1", "x"))
    net.do("a", ClientWrite("w2", "y"))
    net.run()
    assert net.r["a"].commit_seq == 3 and net.r["b"].commit_seq == 1
    before = len(net.sent(Heartbeat))
    net.tick(CFG.commit_notice_ms)
    net.run()
    assert [h.dst for h in net.sent(Heartbeat)[before:]] == ["c"]
    net.drop = lambda m: False
    net.tick(CFG.retry_ms)  # the Append is presumed lost and sent again, with the commit
    net.run()
    assert net.r["b"].commit_seq == 3


def test_no_commit_notice_while_appends_keep_carrying_the_commit() -> None:
    """Under steady writes every Append tells the follower the commit: no notices on top."""
    net = ready_net()
    before = len(net.sent(Heartbeat))
    step = CFG.commit_notice_ms // 2
    for i in range(20):
        net.do("a", ClientWrite(f"w{i}", f"x{i}"))
        net.run()
        net.tick(step)
        net.run()
    assert 20 * step < CFG.heartbeat_ms and len(net.sent(Heartbeat)) == before
    assert net.r["b"].commit_seq == net.r["a"].commit_seq - 1  # one write behind, as Appends tell it


def _one_write_known_everywhere() -> Net:
    """A ready group with seq 2 written, committed, and the commit noticed by b and c."""
    net = ready_net()
    net.do("a", ClientWrite("w", "x"))
    net.run()
    net.tick(CFG.commit_notice_ms)
    net.run()
    return net


def _restart_b(net: Net) -> None:
    """b restarts from its log with the commit it persisted as a hint (none here)."""
    b = net.r["b"]
    net.r["b"] = Replica("b", 0, CFG, stored(b.term, b.entries(1, b.last_seq), commit=0))
    net.effects["b"] = []


def test_a_restarted_follower_announces_itself_and_learns_the_commit_from_a_notice() -> None:
    """An idle group's leader would otherwise tell it only at the next heartbeat."""
    net = _one_write_known_everywhere()
    assert net.r["b"].commit_seq == 2
    _restart_b(net)
    assert net.r["b"].commit_seq == 0
    net.do("b", MetaView(1, "a", VOTERS))  # meta names the leader of b's term
    [hello] = [m for m in net.sent(HeartbeatReply) if m.src == "b" and m.commit is not None]
    assert (hello.dst, hello.commit, hello.round) == ("a", 0, 0)
    net.run()
    net.tick(CFG.commit_notice_ms)
    net.run()
    assert net.r["b"].commit_seq == 2 and net.r["b"].applied_seq == 2
    assert CFG.commit_notice_ms < CFG.heartbeat_ms


def test_without_the_announcement_a_restarted_follower_waits_for_the_heartbeat() -> None:
    """The control for the test above: the notice is what the announcement bought."""
    net = _one_write_known_everywhere()
    _restart_b(net)
    net.drop = lambda m: isinstance(m, HeartbeatReply) and m.commit is not None
    net.do("b", MetaView(1, "a", VOTERS))
    net.run()
    net.tick(CFG.commit_notice_ms)
    net.run()
    assert net.r["b"].commit_seq == 0


def test_only_an_announcement_below_what_the_leader_told_brings_a_notice() -> None:
    net = _one_write_known_everywhere()
    for reply in (HeartbeatReply(src="b", dst="a", group=0, term=1, round=0, commit=2),  # what it was told
                  HeartbeatReply(src="b", dst="a", group=0, term=1, round=0, commit=3),  # above (a newer leader's)
                  HeartbeatReply(src="b", dst="a", group=0, term=1, round=0)):  # an ordinary reply
        before = len(net.sent(Heartbeat))
        net.do("a", reply)
        net.tick(CFG.commit_notice_ms)
        net.run()
        assert len(net.sent(Heartbeat)) == before, reply
    net.do("a", HeartbeatReply(src="b", dst="a", group=0, term=1, round=0, commit=1))
    net.tick(CFG.commit_notice_ms)
    net.run()
    assert [(h.dst, h.commit) for h in net.sent(Heartbeat)[-1:]] == [("b", 2)]


def test_an_announcement_never_counts_as_a_read_confirmation() -> None:
    net = ready_net()
    net.drop = lambda m: isinstance(m, Heartbeat)  # the round's own heartbeats are lost
    net.do("a", ClientRead("r", "q", deadline=net.now + 500))
    net.run()
    net.do("a", HeartbeatReply(src="b", dst="a", group=0, term=1, round=0, commit=1))
    net.do("a", HeartbeatReply(src="c", dst="a", group=0, term=1, round=0, commit=1))
    net.run()
    assert not net.of("a", ServeRead)


def test_a_follower_restarted_across_a_term_change_announces_itself_too() -> None:
    net = _one_write_known_everywhere()
    _restart_b(net)
    net.view(2, "c", VOTERS)  # meta moved the leadership while b was down
    net.run()
    hello = [m for m in net.sent(HeartbeatReply) if m.src == "b" and m.commit is not None]
    assert [(m.dst, m.term) for m in hello] == [("c", 2)]
    assert net.r["c"].ready
    net.tick(CFG.commit_notice_ms)
    net.run()
    assert net.r["b"].commit_seq == net.r["c"].commit_seq >= 3


# ---------------------------------------------------------------------------
# Reads


def test_read_index_round_is_shared() -> None:
    net = ready_net(5)
    hb0 = len(net.sent(Heartbeat))
    net.do("a", ClientRead("r1", "q", deadline=net.now + 500))
    assert len(net.sent(Heartbeat)) - hb0 == 4  # round 1 to every other voter
    net.do("a", ClientRead("r2", "q", deadline=net.now + 500))
    net.do("a", ClientRead("r3", "q", deadline=net.now + 500))
    assert len(net.sent(Heartbeat)) - hb0 == 4  # r2, r3 wait for the next round
    net.run()
    served = net.of("a", ServeRead)
    assert [s.req for s in served] == ["r1", "r2", "r3"]
    assert len(net.sent(Heartbeat)) - hb0 == 8  # exactly two rounds for three reads


def test_strong_read_needs_a_quorum() -> None:
    net = ready_net()
    net.drop = lambda m: isinstance(m, HeartbeatReply)
    net.do("a", ClientRead("r", "q", deadline=net.now + 300))
    net.run()
    assert not net.of("a", ServeRead)
    net.tick(300)
    assert net.of("a", Reply) == [Reply("r", False, 0, 1, "deadline_exceeded", "a")]


def test_strong_read_refused_off_leader() -> None:
    net = ready_net()
    out = net.do("b", ClientRead("r", "q", deadline=net.now + 300))
    assert out[0] == Reply("r", False, 0, 1, "not_leader", "a")


def test_follower_read_waits_for_min_seq() -> None:
    net = ready_net()
    net.drop = lambda m: m.dst == "c"
    net.do("a", ClientWrite("w", "x"))
    net.run()
    out = net.do("c", ClientRead("r", "q", "follower", min_seq=2, deadline=net.now + 1000))
    assert not any(isinstance(e, ServeRead) for e in out)
    net.drop = lambda m: False
    net.tick(CFG.retry_ms)
    net.run()
    net.tick(CFG.heartbeat_ms)
    net.run()
    assert net.of("c", ServeRead) == [ServeRead("r", 2)]


def test_follower_read_deadline() -> None:
    net = ready_net()
    net.do("c", ClientRead("r", "q", "follower", min_seq=9, deadline=net.now + 100))
    net.tick(100)
    assert net.of("c", Reply) == [Reply("r", False, 0, 1, "deadline_exceeded", "a")]


# ---------------------------------------------------------------------------
# Transfer and membership


def test_transfer_refuses_writes_naming_the_target_then_reports() -> None:
    net = ready_net()
    net.drop = lambda m: m.dst == "b"
    net.do("a", ClientWrite("w0", "x"))
    net.run()
    net.do("a", TransferLeader("b"))
    out = net.do("a", ClientWrite("w1", "y"))
    assert out[0] == Reply("w1", False, 0, 1, "not_leader", "b")
    assert not net.of("a", TransferReady)
    net.drop = lambda m: False
    net.tick(CFG.retry_ms)
    net.run()
    assert net.of("a", TransferReady) == [TransferReady("b", 1, 2)]
    net.view(2, "b", VOTERS)
    net.run()
    assert net.r["b"].ready and net.r["a"].role == "follower"


def test_transfer_hands_over_only_once_every_write_taken_is_committed() -> None:
    net = ready_net(4)  # a majority is 3: the leader and its target alone are not one
    net.drop = lambda m: m.dst in ("c", "d")
    net.do("a", ClientWrite("w0", "x"))
    net.do("a", TransferLeader("b"))
    net.run()
    assert net.r["b"].last_seq == net.r["a"].last_seq  # the target has everything
    assert not net.of("a", TransferReady) and not net.of("a", Reply)  # but w0 is not committed
    net.drop = lambda m: m.dst == "d"
    net.tick(CFG.retry_ms)
    net.run()
    assert [r.ok for r in net.of("a", Reply)] == [True]  # w0 answered before the hand-over
    assert net.of("a", TransferReady) == [TransferReady("b", 1, 2)]


def test_transfer_times_out_and_admits_again() -> None:
    net = ready_net()
    net.do("a", TransferLeader("b"))
    net.run()
    assert net.of("a", TransferReady)
    for _ in range(CFG.transfer_timeout_ms // CFG.heartbeat_ms):
        net.tick(CFG.heartbeat_ms)  # (the idle heartbeats keep its quorum)
        net.run()
    out = net.do("a", ClientWrite("w", "x"))
    assert not any(isinstance(e, Reply) for e in out)
    net.run()
    assert net.of("a", Reply)[-1].ok


def test_membership_add_promote_remove() -> None:
    net = Net({x: StoredState() for x in ("a", "b", "c", "d")})
    net.view(1, "a", VOTERS)
    net.run()
    a = net.r["a"]
    net.do("a", ChangeMembership("m1", add_learner="d"))
    out = net.do("a", ChangeMembership("m2", promote="d"))
    assert Reply("m2", False, 0, 1, "busy", "a") in out
    net.run()
    assert net.of("a", Reply)[-1] == Reply("m1", True, 2, 1, None, "a")
    assert a.learners == ("d",) and net.r["d"].role == "learner" and net.r["d"].last_seq == 2
    out = net.do("a", ChangeMembership("m3", promote="d"))
    assert out[-1].error_code == "busy"  # meta has not recorded conf_ver 2 yet
    net.view(1, "a", VOTERS, ("d",), conf_ver=2)
    net.do("a", ChangeMembership("m3", promote="d"))
    net.run()
    assert a.voters == ("a", "b", "c", "d") and a.learners == ()
    net.view(1, "a", ("a", "b", "c", "d"), (), conf_ver=3)
    out = net.do("a", ChangeMembership("m4", remove="a"))
    assert out[-1].error_code == "bad_request"
    net.do("a", ChangeMembership("m5", remove="b"))
    net.run()
    assert a.voters == ("a", "c", "d")
    assert net.of("a", Reply)[-1] == Reply("m5", True, 4, 1, None, "a")


def test_promote_refused_while_learner_lags() -> None:
    net = Net({x: StoredState() for x in ("a", "b", "c", "d")}, ReplicaConfig(promote_max_lag=2))
    net.view(1, "a", VOTERS)
    net.run()
    net.do("a", ChangeMembership("m1", add_learner="d"))
    net.run()
    net.view(1, "a", VOTERS, ("d",), conf_ver=2)
    net.drop = lambda m: m.dst == "d"
    for i in range(5):
        net.do("a", ClientWrite(f"w{i}", i))
    net.run()
    out = net.do("a", ChangeMembership("m2", promote="d"))
    assert out[-1].error_code == "lagging"


def test_begin_also_needs_the_unrecorded_log_config() -> None:
    # a's log holds config {a, d, e} that meta (conf_ver 0) never recorded:
    # a majority of meta's voters alone is not enough.
    cfg_entry = Entry(1, 2, "config", Config(("a", "d", "e")))
    net = Net({x: StoredState() for x in ("a", "b", "c", "d", "e")})
    net.r["a"] = Replica("a", 0, CFG, stored(1, [Entry(1, 1, "term_start"), cfg_entry]))
    net.drop = lambda m: m.dst in ("d", "e")
    net.view(2, "a", VOTERS)
    net.run()
    assert net.r["a"].role == "candidate"
    net.drop = lambda m: False
    net.tick(CFG.retry_ms)
    net.run()
    assert net.r["a"].ready and net.r["a"].voters == ("a", "d", "e")


# ---------------------------------------------------------------------------
# Snapshots and restart


def test_compact_then_lagging_follower_gets_snapshot() -> None:
    net = ready_net()
    net.drop = lambda m: m.dst == "c"
    for i in range(4):
        net.do("a", ClientWrite(f"w{i}", i, rid=f"r{i}"))
        net.run()
    a = net.r["a"]
    net.do("a", Compact(a.applied_seq))
    # c still needs those entries: held back, but only for compact_hold_ms
    assert a.snapshot_seq == 0
    net.tick(CFG.compact_hold_ms - 1)
    assert a.snapshot_seq == 0
    net.tick(1)
    net.run()
    assert a.snapshot_seq == 5 and a.entries(1, 5) == []
    net.drop = lambda m: False
    net.tick(CFG.snapshot_retry_ms)
    net.run()
    need = [m for m in net.sent(SnapshotNeeded) if m.dst == "c"]
    assert need and net.of("c", DownloadSnapshot)
    # What the sender's shell publishes with the request reaches the download, untouched.
    out = net.do("c", SnapshotNeeded(src="a", dst="c", group=0, term=net.r["c"].term, snap_term=need[-1].snap_term,
                                     snap_seq=5, digest="ab" * 16, size=1234))
    [dl] = [e for e in out if isinstance(e, DownloadSnapshot)]
    assert (dl.source, dl.seq, dl.snap_term, dl.digest, dl.size) == ("a", 5, need[-1].snap_term, "ab" * 16, 1234)
    meta = [e for e in net.effects["a"] if isinstance(e, Persist) and e.snapshot][-1].snapshot
    net.do("c", SnapshotInstalled(meta))
    net.run()
    c = net.r["c"]
    assert c.applied_seq == 5 and c.snapshot_seq == 5
    # the dedup table travelled with the snapshot
    net.view(2, "c", VOTERS)
    net.run()
    out = net.do("c", ClientWrite("again", 0, rid="r0"))
    assert out[0] == Reply("again", True, 2, 2, None, "c")


def test_leader_holds_compaction_until_a_slow_follower_has_the_entries() -> None:
    # Under load a follower is normally an Append or two behind; compacting
    # under it would cost it a whole snapshot download.
    net = ready_net()
    a = net.r["a"]
    net.do("a", ClientWrite("w0", 0, rid="r0"))
    net.run()
    net.drop = lambda m: m.dst == "c" or m.src == "c"
    for i in range(1, 4):
        net.do("a", ClientWrite(f"w{i}", i, rid=f"r{i}"))
        net.run()
    assert a.applied_seq == 5
    net.do("a", Compact(a.applied_seq))
    assert a.snapshot_seq == 0 and not [e for e in net.of("a", Persist) if e.snapshot]
    # b and c are followers: they compact at once, whoever lags
    net.do("b", Compact(net.r["b"].applied_seq))
    assert net.r["b"].snapshot_seq == net.r["b"].applied_seq
    net.drop = lambda m: False
    net.tick(CFG.retry_ms)
    net.run()
    assert net.r["c"].last_seq == 5
    assert a.snapshot_seq == 5 and a.entries(1, 5) == []
    assert not net.sent(SnapshotNeeded) and not net.of("c", DownloadSnapshot)
    # a second Compact while one is held replaces it (one Persist, at the newer seq)
    net.drop = lambda m: m.dst == "c" or m.src == "c"
    net.do("a", ClientWrite("w4", 4, rid="r4"))
    net.run()
    net.do("a", Compact(6))
    net.do("a", ClientWrite("w5", 5, rid="r5"))
    net.run()
    net.do("a", Compact(7))
    net.drop = lambda m: False
    net.tick(CFG.retry_ms)
    net.run()
    snaps = [e.snapshot.seq for e in net.of("a", Persist) if e.snapshot]
    assert snaps == [5, 7] and not net.sent(SnapshotNeeded)


def test_the_core_picks_snapshot_points_and_keeps_their_meta() -> None:
    # Every 3 client writes: the Apply ends at the point, TakeSnapshot follows,
    # and the Compact that answers it uses the meta made then (no replay).
    cfg = ReplicaConfig(snapshot_every=3, dedup_max=4)
    net = ready_net(cfg=cfg)
    a = net.r["a"]
    net.drop = lambda m: m.src != "a"  # nothing commits until the replies flow again
    for i in range(3):
        net.do("a", ClientWriteMany((f"m{i}a", f"m{i}b"), ("x", "y"), "quorum", (f"r{i}a", f"r{i}b")))
        net.run()
        net.now += 7  # distinct entry timestamps
    before = len(net.effects["a"])
    net.drop = lambda m: False
    net.tick(CFG.retry_ms)
    net.run()
    effs = [e for e in net.effects["a"][before:] if isinstance(e, (Apply, TakeSnapshot))]
    # 2 + 2 writes reach 3 at seq 3 (counted in writes, not entries); the
    # last entry's 2 writes are short of the next point
    assert [[x.seq for x in e.entries] if isinstance(e, Apply) else e.seq for e in effs] == [[2, 3], 3, [4]]
    net.tick(cfg.heartbeat_ms)  # the followers learn the commit
    net.run()
    assert net.of("b", TakeSnapshot) == [TakeSnapshot(3)]
    assert a.applied_seq == 4
    replayed = a._snapshot_meta_at(3)  # the slow way: from the start, dedup expiry included
    net.do("a", Compact(3))
    meta = [e for e in net.of("a", Persist) if e.snapshot][-1].snapshot
    assert meta == replayed and meta.seq == 3 and len(meta.dedup) == 4


def test_snapshot_points_asked_while_one_is_written_keep_the_metas_the_shell_answers() -> None:
    # The shell is still writing point 2 when 3 and 4 are asked for; it skips
    # those, answers 2, and takes the next point it reaches (here 4).
    net = ready_net(cfg=ReplicaConfig(snapshot_every=1))
    a = net.r["a"]
    for i in range(3):
        net.do("a", ClientWrite(f"w{i}", i, rid=f"r{i}"))
        net.run()
    net.tick(CFG.heartbeat_ms)
    net.run()
    assert [t.seq for t in net.of("a", TakeSnapshot)] == [2, 3, 4]
    slow = a._snapshot_meta_at
    replays: list[int] = []
    a._snapshot_meta_at = lambda seq, exact=None: replays.append(seq) or slow(seq, exact)  # type: ignore[method-assign]
    net.do("a", Compact(2))
    net.do("a", Compact(4))
    assert replays == [] and a.snapshot_seq == 4
    assert [e.snapshot.seq for e in net.of("a", Persist) if e.snapshot] == [2, 4]


def test_restart_applies_stored_commit_once() -> None:
    r = Replica("b", 0, CFG, stored(1, [op(1, 1), op(1, 2), op(1, 3)], commit=2))
    out = r.handle(Tick(), 5)
    assert [e.seq for x in out if isinstance(x, Apply) for e in x.entries] == [1, 2]
    out = r.handle(Tick(), 6)
    assert not any(isinstance(x, Apply) for x in out)


def test_dedup_table_expiry_and_bound() -> None:
    d = DedupTable(window_ms=100, max_entries=3)
    for i, ts in enumerate([0, 10, 20, 30]):
        d.apply(Entry(1, i + 1, "op", None, f"r{i}", ts))
    assert d.lookup("r0") is None and d.lookup("r1") == 2  # bounded to 3
    d.apply(Entry(1, 5, "op", None, None, 115))
    assert d.lookup("r1") is None and d.lookup("r2") == 3  # 10 < 115 - 100
    again = DedupTable(100, 3, d.export(), d.newest_ts)
    assert again.export() == d.export()


# ---------------------------------------------------------------------------
# Check-quorum and the leader's silence


@pytest.mark.parametrize("cut", ["both", "leader_cannot_send", "leader_cannot_receive"])
def test_a_leader_cut_from_its_followers_refuses_promptly_and_says_so(cut: str) -> None:
    net = ready_net()
    a = net.r["a"]
    drops: dict[str, Callable[[Message], bool]] = {
        "both": lambda m: "a" in (m.src, m.dst),
        "leader_cannot_send": lambda m: m.src == "a",
        "leader_cannot_receive": lambda m: m.dst == "a",
    }
    net.drop = drops[cut]
    net.do("a", ClientWrite("w1", "x"))
    net.run()
    net.tick(CFG.lease_ms - 1)
    net.run()
    assert a.has_quorum and not net.of("a", ReportQuorum) and not net.replies("a")
    net.tick(1)
    # The write it took is answered now (outcome unknown), not after quorum_timeout.
    assert not a.has_quorum and a.quorum_lost_at == net.now
    assert net.of("a", ReportQuorum) == [ReportQuorum(1, False)]
    assert net.replies("a") == [Reply("w1", False, 0, 1, "quorum_timeout", "a")]
    # New writes, strong reads, membership changes and transfers are refused at once.
    last = a.last_seq
    net.do("a", ClientWrite("w2", "y"))
    net.do("a", ClientRead("r", "q", "strong"))
    net.do("a", ChangeMembership("m", add_learner="d"))
    net.do("a", TransferLeader("b"))
    assert [(r.req, r.error_code) for r in net.replies("a")[1:]] == [("w2", NO_QUORUM), ("r", NO_QUORUM),
                                                                      ("m", NO_QUORUM)]
    assert a.last_seq == last and a.transfer_target is None
    # The link heals: the next heartbeat's replies restore it.
    net.drop = lambda m: False
    net.tick(CFG.heartbeat_ms)
    net.run()
    assert a.has_quorum and a.quorum_lost_at is None
    assert net.of("a", ReportQuorum)[-1] == ReportQuorum(1, True)
    net.do("a", ClientWrite("w3", "z"))
    net.run()
    assert net.replies("a")[-1].ok


def test_one_cut_follower_leaves_the_quorum_alone() -> None:
    net = ready_net()
    net.drop = lambda m: {m.src, m.dst} == {"a", "c"}
    for _ in range(4 * CFG.lease_ms // CFG.heartbeat_ms):
        net.tick(CFG.heartbeat_ms)
        net.run()
    a = net.r["a"]
    assert a.has_quorum and not net.of("a", ReportQuorum)
    net.do("a", ClientWrite("w", "x"))
    net.run()
    assert net.replies("a")[-1].ok
    # ... and c, which hears nothing, knows since when.
    c = net.r["c"]
    assert c.leader_heard_at is not None and net.now - c.leader_heard_at >= 3 * CFG.lease_ms
    assert net.now - net.r["b"].leader_heard_at <= CFG.heartbeat_ms
    assert a.leader_heard_at is None  # a leader reports its quorum instead


def test_an_idle_leader_keeps_its_quorum_on_heartbeats() -> None:
    net = ready_net()
    for _ in range(10):
        net.tick(CFG.heartbeat_ms)
        net.run()
    assert net.r["a"].has_quorum and not net.of("a", ReportQuorum)


def test_a_leader_without_promises_reports_no_quorum_then_recovers() -> None:
    net = Net({x: StoredState() for x in VOTERS})
    net.drop = lambda m: isinstance(m, Begin)
    net.view(1, "a", VOTERS)
    net.run()
    a = net.r["a"]
    net.do("a", ClientWrite("w1", "x"))
    assert net.replies("a")[-1].error_code == "not_leader"  # starting: retry here soon
    net.tick(CFG.lease_ms)
    net.run()
    assert not a.has_quorum and net.of("a", ReportQuorum) == [ReportQuorum(1, False)]
    net.do("a", ClientWrite("w2", "x"))
    assert net.replies("a")[-1].error_code == NO_QUORUM
    net.drop = lambda m: False
    net.tick(CFG.retry_ms)
    net.run()
    assert a.ready and a.has_quorum and net.of("a", ReportQuorum)[-1] == ReportQuorum(1, True)


def test_entry_timestamps_are_log_time_carried_from_leader_to_leader() -> None:
    """A leader stamps entries with the adopted log's last timestamp plus its
    own elapsed time, whatever its clock reads: replicas' clocks here are a
    day apart, and the dedup window still holds."""
    net = ready_net(cfg=ReplicaConfig(dedup_window_ms=1000))
    for _ in range(8):
        net.tick(CFG.heartbeat_ms)
        net.run()
    assert net.now == 5_000
    net.do("a", ClientWrite("w1", "x", rid="r1"))
    net.run()
    e = net.r["a"].entries(2, 2)[0]
    assert e.ts == 5_000 - 1000  # ready_net's term started at now=1000 with an empty log (ts 0)
    # b takes over with a clock a day ahead: its term continues at the log's last timestamp.
    day = 86_400_000
    for n in net.r:
        net.do(n, MetaView(2, "b", VOTERS))
    b = net.r["b"]
    start = net.now

    def run_at_b_clock() -> None:
        while net.queue:
            m = net.queue.pop(0)
            net.effects[m.dst].extend(out := net.r[m.dst].handle(m, net.now + (day if m.dst == "b" else 0)))
            net.queue.extend(x.msg for x in out if isinstance(x, Send))

    for n in net.r:
        out = net.r[n].handle(MetaView(2, "b", VOTERS), net.now + (day if n == "b" else 0))
        net.queue.extend(x.msg for x in out if isinstance(x, Send))
    run_at_b_clock()
    assert b.ready
    term_start = b.entries(3, 3)[0]
    assert term_start.kind == "term_start" and term_start.ts == e.ts
    # A retry of r1, 500 ms of b's time later, is still known: answered with seq 2.
    out = b.handle(ClientWrite("w1-again", "x", rid="r1"), start + day + 500)
    assert [r for r in out if isinstance(r, Reply)] == [Reply("w1-again", True, 2, 2, None, "b")]
    out = b.handle(ClientWrite("w2", "y", rid="r2"), start + day + 600)
    net.queue.extend(x.msg for x in out if isinstance(x, Send))
    run_at_b_clock()
    assert b.entries(4, 4)[0].ts == e.ts + 600


def test_without_quorum_a_known_rid_is_answered_as_what_it_is() -> None:
    """A client re-sending after a lost answer must not hear "nothing applied"
    for a write that applied (its seq) or may still commit (quorum_timeout)."""
    net = ready_net()
    a = net.r["a"]
    net.do("a", ClientWrite("w1", "x", rid="r1"))
    net.run()
    assert net.replies("a")[-1].ok and net.replies("a")[-1].seq == 2
    net.drop = lambda m: m.dst == "a"  # replies lost from here on
    net.do("a", ClientWrite("w2", "y", rid="r2"))
    net.run()
    net.tick(CFG.lease_ms)
    assert not a.has_quorum and net.replies("a")[-1] == Reply("w2", False, 0, 1, "quorum_timeout", "a")
    for many in (False, True):
        before = len(net.replies("a"))
        if many:
            net.do("a", ClientWriteMany(("m1", "m2", "m3"), ("x", "y", "z"), "quorum", ("r1", "r2", "r3")))
        else:
            for req, rid in (("m1", "r1"), ("m2", "r2"), ("m3", "r3")):
                net.do("a", ClientWrite(req, "v", rid=rid))
        got = [(r.req, r.ok, r.seq, r.error_code) for r in net.replies("a")[before:]]
        assert got == [("m1", True, 2, None), ("m2", False, 0, "quorum_timeout"), ("m3", False, 0, NO_QUORUM)]


def test_a_leader_whose_fetch_source_goes_silent_asks_a_majority_again() -> None:
    # c has the best log; a must fetch it, and c dies right after promising.
    net = Net({"a": stored(1, [op(1, 1)]), "b": stored(1, [op(1, 1)]),
               "c": stored(1, [op(1, 1), op(1, 2), op(1, 3)])})
    net.drop = lambda m: isinstance(m, Fetch) or (isinstance(m, Begin) and m.dst == "b")
    net.view(2, "a", VOTERS)
    net.run()
    a = net.r["a"]
    assert a.role == "candidate" and not a.ready  # fetching from c, which promised
    net.drop = lambda m: "c" in (m.src, m.dst)
    for _ in range(CFG.lease_ms // CFG.heartbeat_ms + 1):
        net.tick(CFG.heartbeat_ms)
        net.run()
        # b, which promised, keeps hearing us meanwhile: it must not report us silent.
        assert net.now - net.r["b"].leader_heard_at <= CFG.heartbeat_ms
    # The Begin round ran again with a and b: their best log, c's unacknowledged tail gone.
    assert a.ready and log_of(a) == [(1, 1), (2, 2)] and a.has_quorum


def test_a_voter_that_cannot_answer_can_still_be_removed() -> None:
    """Two voters, one dead: removing it is what gives the group a quorum again."""
    net = ready_net(n=2)
    net.drop = lambda m: "b" in (m.src, m.dst)
    net.tick(CFG.lease_ms)
    a = net.r["a"]
    assert not a.has_quorum
    net.do("a", ChangeMembership("m", remove="b"))
    assert net.replies("a")[-1] == Reply("m", True, 2, 1, None, "a") and a.voters == ("a",) and a.has_quorum
    net.do("a", ClientWrite("w", "x"))
    assert net.replies("a")[-1].ok
    # (Adding is refused: it would not restore a quorum.)
    net = ready_net(n=2)
    net.drop = lambda m: "b" in (m.src, m.dst)
    net.tick(CFG.lease_ms)
    net.do("a", ChangeMembership("m", add_learner="c"))
    assert net.replies("a")[-1].error_code == NO_QUORUM


def test_no_transfer_to_a_voter_the_leader_cannot_hear() -> None:
    net = ready_net()
    net.drop = lambda m: m.src == "c"  # c hears us, we do not hear c
    for _ in range(CFG.lease_ms // CFG.heartbeat_ms):
        net.tick(CFG.heartbeat_ms)
        net.run()
    a = net.r["a"]
    net.do("a", TransferLeader("c"))
    assert a.transfer_target is None  # it would hold writes up until the transfer timed out
    net.do("a", TransferLeader("b"))
    assert a.transfer_target == "b"
