"""`topoctl status` rendering (the human view of meta's cluster state)."""
from __future__ import annotations

import pytest

from shardgrid.health import assess
from shardgrid.topoctl import gather_status, render_status


def test_status_marks_groups_away_from_their_preferred_leader() -> None:
    st = {
        "topology": {"cluster": "c1"}, "revision": 9, "topology_revision": 1, "meta_leader": "m1",
        "meta_nodes": [{"id": "m1", "http": "127.0.0.1:7101", "up": True, "role": "leader", "revision": 9}],
        "groups": {
            "0": {"term": 3, "leader": "w2", "ready": True, "preferred_leader": "w1", "voters": ["w1", "w2", "w3"],
                  "learners": []},
            "1": {"term": 1, "leader": "w2", "ready": True, "preferred_leader": "w2", "voters": ["w1", "w2", "w3"],
                  "learners": []},
        },
        "workers": {"w1": {"addr": "127.0.0.1:7201", "zone": "a", "state": "active", "live": True}},
    }
    lines = render_status(st).splitlines()
    header = next(line for line in lines if line.startswith("GROUP"))
    rows = {line.split()[0]: line.split() for line in lines if line[:1].isdigit()}
    assert "PREFERRED" in header.split()
    assert rows["0"][4] == "w1*" and rows["1"][4] == "w2"  # '*': away from its preferred leader


def _with_reports(reports: dict[str, dict | None]) -> dict:
    """Groups 0 and 1 on w1,w2,w3, led by w1 and w2 at term 3, as the meta leader's view
    (a worker given `...` carries no report: a meta follower's view)."""
    return {
        "topology": {"cluster": "c1", "replication_factor": 3, "settings": {"lease_ms": 1500}}, "revision": 9,
        "topology_revision": 1, "meta_leader": "m1", "meta_leader_for_ms": 60_000,
        "meta_nodes": [{"id": "m1", "http": "127.0.0.1:7101", "up": True, "role": "leader", "revision": 9}],
        "groups": {gid: {"term": 3, "leader": leader, "ready": True, "preferred_leader": leader,
                         "voters": ["w1", "w2", "w3"], "learners": []} for gid, leader in (("0", "w1"), ("1", "w2"))},
        "workers": {wid: {"addr": f"127.0.0.1:720{i}", "zone": "a", "state": "active", "live": True,
                          "last_seen_ms_ago": 100, **({} if rep is ... else {"report": rep})}
                    for i, (wid, rep) in enumerate(sorted(reports.items()))},
    }


def _healthy(term: int = 3) -> dict:
    return {"term": term, "role": "follower", "failed": None, "resyncing": False}


def _rep(gid: str, **kw: object) -> dict:
    """A replica in step: the leader named in _with_reports leads, the others follow."""
    leads = (gid, kw.get("_me")) in (("0", "w1"), ("1", "w2"))
    out = {"term": 3, "role": "leader" if leads else "follower", "ready": leads, "quorum": True,
           "leader": "w1" if gid == "0" else "w2", "leader_silence_ms": None if leads else 40,
           "last_seq": 10, "commit": 10, "applied": 10, "failed": None, "resyncing": False}
    out.update({k: v for k, v in kw.items() if k != "_me"})
    return out


def _reports(**special: dict) -> dict[str, dict | None]:
    """Every worker reporting both groups in step, but for `special` ("w2_0": overrides)."""
    return {w: {"groups": {g: _rep(g, _me=w, **special.get(f"{w}_{g}", {})) for g in ("0", "1")}}
            for w in ("w1", "w2", "w3")}


def _verdict_lines(st: dict) -> list[str]:
    """The status's opening: the verdict and its reasons, up to the first blank line."""
    lines = render_status(st, assess(st)).splitlines()
    return lines[:lines.index("")]


def test_status_opens_with_every_replica_that_cannot_serve_and_why() -> None:
    st = _with_reports(_reports(w3_1={"failed": "Unappliable: unknown op kind put_item_v2"},
                                w2_0={"resyncing": True}))
    st["workers"]["w3"]["report"]["groups"]["0"] = {"state": "corrupt", "error": "wal record 17: bad checksum"}
    head = _verdict_lines(st)
    # Group 0 keeps one voter able to serve (w2 re-syncs, w3 is corrupt): no quorum.
    assert head[0].startswith("red")
    assert "  red     group 0: 1 of 3 voters can serve; a quorum needs 2" in head
    assert "  yellow  group 0: voter w2 resyncing: lost its log; catching up from a peer, neither votes nor leads" \
        in head
    assert "  yellow  group 0: voter w3 corrupt: wal record 17: bad checksum" in head
    assert "  yellow  group 1: voter w3 failed: Unappliable: unknown op kind put_item_v2" in head
    # The same judgement, replica by replica, in the lag table.
    states = {(line.split()[0], line.split()[1]): line.split()[3] for line in render_status(st, assess(st)).splitlines()
              if line[:1].isdigit() and len(line.split()) == 8}
    assert states[("0", "w2")] == "resyncing" and states[("1", "w3")] == "failed" and states[("0", "w1")] == "ok"


def test_status_says_green_when_no_replica_has_a_problem_and_yellow_when_it_cannot_know() -> None:
    healthy = _verdict_lines(_with_reports(_reports()))
    assert healthy == ["green: every group has a ready leader and its voters in sync"]
    # A meta follower's view carries no heartbeat reports: that is "unknown", not "healthy".
    blind = _verdict_lines(_with_reports({"w1": ..., "w2": ..., "w3": ...}))
    assert blind[0].startswith("yellow") and any("health unknown" in line for line in blind)


def test_status_shows_a_leader_without_quorum_and_replicas_cut_off_from_their_leader() -> None:
    st = _with_reports(_reports(w1_0={"quorum": False, "no_quorum_ms": 2300},
                                w2_0={"leader_silence_ms": 3800}, w3_0={"leader_silence_ms": 1499}))
    head = _verdict_lines(st)
    assert head[0].startswith("red")
    assert any(line.startswith("  red     group 0: leader w1 no-quorum: no round trip with a majority of its "
                               "voters for 2300 ms") for line in head), head
    assert any(line.startswith("  yellow  group 0: voter w2 cut-off: has not heard from its leader for 3800 ms")
               for line in head), head
    assert not any("w3" in line for line in head)  # 1499 ms: still within the lease

def test_status_shows_what_each_worker_offers() -> None:
    st = _with_reports({"w1": ..., "w4": ...})
    st["workers"]["w4"].update(state="available", ram_bytes=8 * 10**9, disk_bytes=50 * 10**9)
    rows = {line.split()[0]: line for line in render_status(st).splitlines() if line.startswith("w")}
    assert rows["w4"].split(None, 10)[10] == "ram 8 GB, disk 50 GB" and "available" in rows["w4"]
    assert rows["w1"].rstrip().endswith("-")


def test_status_shows_load_per_group_and_per_worker() -> None:
    st = _with_reports({"w1": {"groups": {"0": {**_healthy(), "role": "leader", "write_rate": 120.4},
                                          "1": _healthy()}},
                        "w2": {"groups": {"1": {**_healthy(), "role": "leader", "write_rate": 30.0},
                                          "0": _healthy()}}})
    st["groups"] = {"0": {"term": 3, "leader": "w1", "ready": True, "preferred_leader": "w1",
                          "voters": ["w1", "w2"], "learners": []},
                    "1": {"term": 3, "leader": "w2", "ready": True, "preferred_leader": "w2",
                          "voters": ["w1", "w2"], "learners": []},
                    "2": {"term": 3, "leader": "w2", "ready": True, "preferred_leader": "w2",
                          "voters": ["w2"], "learners": []}}
    lines = render_status(st).splitlines()
    groups = {ln.split()[0]: ln.split() for ln in lines if ln[:1].isdigit()}
    assert groups["0"][-1] == "120" and groups["1"][-1] == "30" and groups["2"][-1] == "?"  # 2: no report
    workers = {ln.split()[0]: ln.split() for ln in lines if ln.startswith("w")}
    assert workers["w1"][6:9] == ["2", "1", "120"]  # groups hosted, leaderships, writes/s led
    assert workers["w2"][6:9] == ["3", "2", "?"]  # it leads group 2, whose rate is unknown


def test_status_shows_admission_software_gateways_and_refusals() -> None:
    st = {"revision": 3, "topology_revision": 1, "meta_leader": "m1", "topology": None,
          "meta_nodes": [{"id": "m1", "http": "127.0.0.1:7101", "up": True, "role": "leader", "revision": 3}],
          "groups": {},
          "workers": {"w1": {"addr": "a:1", "zone": "a", "state": "active", "admission": "admitted", "live": True,
                             "version": "0.1.0", "code_digest": "0123456789abcdef"},
                      "w2": {"addr": "a:2", "zone": "b", "state": "active", "admission": "revoked", "live": False,
                             "version": "0.1.0", "code_digest": "fedcba9876543210"}},
          "gateways": [{"id": "g1", "addr": "a:8080", "admission": "admitted", "last_seen_ms_ago": 2000,
                        "version": "0.1.0", "code_digest": "0123456789abcdef"}],
          "refusals": [{"principal": "worker:w9", "addr": "10.0.0.9", "reason": "version_mismatch"},
                       {"principal": "worker:w1", "claimed": True, "addr": "10.0.0.8", "reason": "unknown_credentials"}]}
    out = render_status(st)
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines() if ln.startswith(("w", "g1"))}
    assert rows["w1"][4] == "admitted" and rows["w2"][4] == "revoked"
    assert "0.1.0 (01234567)" in out and "0.1.0 (fedcba98)" in out  # same version, other code: visible
    assert rows["g1"][:3] == ["g1", "a:8080", "admitted"]
    assert "worker:w9 from 10.0.0.9: version_mismatch" in out and "worker:w1 (claimed) from 10.0.0.8: unknown_credentials" in out


def _pinned(groups: dict[str, dict], workers: dict[str, dict]) -> dict:
    """A status whose applied file pins every group on w1,w2,w3 (leaders w1, w2)."""
    topo = {"cluster": "c1", "groups_explicit": True,
            "groups": [{"id": 0, "leader": "w1", "replicas": ["w1", "w2", "w3"]},
                       {"id": 1, "leader": "w2", "replicas": ["w1", "w2", "w3"]}]}
    return {
        "topology": topo, "revision": 9, "topology_revision": 1, "meta_leader": "m1",
        "meta_nodes": [{"id": "m1", "http": "127.0.0.1:7101", "up": True, "role": "leader", "revision": 9}],
        "groups": {gid: {"term": 3, "ready": True, "learners": [], **g} for gid, g in groups.items()},
        "workers": {wid: {"addr": "127.0.0.1:7201", "zone": "a", "state": "active", "live": True, **w}
                    for wid, w in workers.items()},
        "operators": {},
    }


def test_status_shows_drift_from_the_applied_file_and_why() -> None:
    st = _pinned({"0": {"leader": "w1", "preferred_leader": "w1", "voters": ["w1", "w2", "w3"],
                        "desired": ["w1", "w2", "w3"]},
                  "1": {"leader": "w2", "preferred_leader": "w2", "voters": ["w1", "w2", "w4"],
                        "desired": ["w1", "w2", "w4"]}},
                 {"w1": {}, "w2": {}, "w3": {"state": "removed", "live": False}, "w4": {}})
    lines = render_status(st).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("DRIFT"))
    assert lines[start + 1:] == [
        "  group 1: file w1,w2,w3; live w1,w2,w4 (w3 removed: repaired onto w4; "
        "the controller keeps w1,w2,w4 until the file is applied again)",
    ]


def test_status_shows_no_drift_section_when_the_cluster_is_the_file() -> None:
    same = {"voters": ["w1", "w2", "w3"], "desired": ["w1", "w2", "w3"]}
    st = _pinned({"0": {"leader": "w1", "preferred_leader": "w1", **same},
                  "1": {"leader": "w2", "preferred_leader": "w2", **same}},
                 {"w1": {}, "w2": {}, "w3": {}})
    assert "DRIFT" not in render_status(st)
    # The same cluster with the file's leader of group 0 failed over is drift.
    st["groups"]["0"]["leader"] = "w2"
    assert "  group 0: file w1,w2,w3 leader w1; live w1,w2,w3 leader w2 (leader balance moves it back to w1 " \
           "once w1 is caught up)" in render_status(st).splitlines()


async def test_status_json_carries_the_drift() -> None:
    st = _pinned({"0": {"leader": "w1", "preferred_leader": "w1", "voters": ["w1", "w2", "w4"],
                        "desired": ["w1", "w2", "w4"]},
                  "1": {"leader": "w2", "preferred_leader": "w2", "voters": ["w1", "w2", "w3"],
                        "desired": ["w1", "w2", "w3"]}},
                 {"w1": {}, "w2": {}, "w3": {"state": "draining"}, "w4": {}})
    st.update(meta=[{"id": "m1", "http": "127.0.0.1:7101"}], served_by="m1")
    del st["meta_nodes"]

    class FakeMeta:
        async def cluster(self, deadline_s: float | None = None) -> dict:
            return st

        async def status(self, http: str, timeout_s: float = 2.0) -> dict:
            return {"role": "leader", "leader": "m1", "revision": 9, "raft_term": 2}

    out = await gather_status(FakeMeta())  # type: ignore[arg-type]
    (d,) = out["drift"]
    assert d["group"] == 0 and d["voters"] == ("w1", "w2", "w4") and d["file_replicas"] == ("w1", "w2", "w3")
    assert d["line"].startswith("group 0: file w1,w2,w3; live w1,w2,w4 (w3 draining: drained onto w4")


class _TimedMeta:
    """A meta whose follower m2 answers first; each ask moves a fake monotonic clock on
    by what it takes, and records the deadline or timeout topoctl gave it."""

    def __init__(self, takes: list[float]) -> None:
        self.t = 0.0
        self.takes = takes
        self.cluster_deadlines: list[float | None] = []
        self.status_timeouts: list[float] = []
        self.preferred: list[str] = []

    def prefer(self, http: str) -> None:
        self.preferred.append(http)

    async def cluster(self, deadline_s: float | None = None) -> dict:
        self.cluster_deadlines.append(deadline_s)
        self.t += self.takes.pop(0)
        return {"meta": [{"id": "m1", "http": "h1:7101"}, {"id": "m2", "http": "h2:7101"}, {"id": "m3", "http": "h3:7101"}],
                "meta_leader": "m1", "served_by": "m2" if len(self.cluster_deadlines) == 1 else "m1",
                "topology": None, "groups": {}, "workers": {}}

    async def status(self, http: str, timeout_s: float = 2.0) -> dict:
        self.status_timeouts.append(timeout_s)
        return {"role": "follower", "leader": "m1", "revision": 9, "raft_term": 2, "has_quorum": True,
                "peers": {"m1": {"raft": "h1:7201", "http": "h1:7101", "connected": True}}}


async def test_gather_status_spends_no_more_than_the_time_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace
    from shardgrid import topoctl

    meta = _TimedMeta([1.0, 1.2])
    monkeypatch.setattr(topoctl, "time", SimpleNamespace(monotonic=lambda: meta.t))
    st = await gather_status(meta, deadline_s=2.5)  # type: ignore[arg-type]
    # Each node's own Raft view goes into meta_nodes, for the verdict's meta rules.
    assert st["meta_nodes"][0]["has_quorum"] is True and st["meta_nodes"][0]["peers"] == {"m1": {"connected": True}}
    # The re-ask at the leader gets what is left (1.5 s, not its own 3 s), and each node's
    # /v1/status what is left after that (0.3 s, not its own 2 s).
    assert meta.cluster_deadlines == [2.5, pytest.approx(1.5)] and meta.preferred == ["h1:7101"]
    assert meta.status_timeouts == [pytest.approx(0.3)] * 3
    # Nothing left after the first ask: no re-ask at all.
    meta = _TimedMeta([2.5])
    await gather_status(meta, deadline_s=2.5)  # type: ignore[arg-type]
    assert meta.cluster_deadlines == [2.5] and meta.preferred == []
    # Without a deadline (apply --dry-run): the client's own, then 3 s and 2 s as before.
    meta = _TimedMeta([1.0, 1.0])
    await gather_status(meta)  # type: ignore[arg-type]
    assert meta.cluster_deadlines == [None, 3.0] and meta.status_timeouts == [2.0] * 3


def test_status_gathers_within_its_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardgrid import topoctl
    from tests.tier1.test_health import healthy

    seen: list[float | None] = []

    async def gather(client: object, deadline_s: float | None = None) -> dict:
        seen.append(deadline_s)
        return healthy()

    class _Client:
        async def __aenter__(self) -> "_Client":
            return self

        async def __aexit__(self, *exc: object) -> None:
            pass

    monkeypatch.setattr(topoctl, "gather_status", gather)
    monkeypatch.setattr(topoctl, "_client", lambda args, **kw: _Client())
    assert topoctl.main(["status", "--timeout", "4"]) == 0 and topoctl.main(["status"]) == 0
    assert seen == [4.0, topoctl.META_DEADLINE_S]
