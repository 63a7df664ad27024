"""`topoctl status` rendering (the human view of meta's cluster state)."""
from __future__ import annotations

import pytest

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
    return {
        "topology": {"cluster": "c1"}, "revision": 9, "topology_revision": 1, "meta_leader": "m1",
        "meta_nodes": [{"id": "m1", "http": "127.0.0.1:7101", "up": True, "role": "leader", "revision": 9}],
        "groups": {},
        "workers": {wid: {"addr": f"127.0.0.1:720{i}", "zone": "a", "state": "active", "live": True,
                          **({} if rep is ... else {"report": rep})}
                    for i, (wid, rep) in enumerate(sorted(reports.items()))},
    }


def _healthy(term: int = 3) -> dict:
    return {"term": term, "role": "follower", "failed": None, "resyncing": False}


def test_status_lists_every_replica_that_cannot_serve_and_why() -> None:
    st = _with_reports({
        "w1": {"groups": {"0": _healthy(), "1": {**_healthy(), "failed": "Unappliable: unknown op kind put_item_v2"}}},
        "w2": {"groups": {"0": {**_healthy(), "resyncing": True}, "1": _healthy()}},
        "w3": {"groups": {"0": {"state": "corrupt", "error": "wal record 17: bad checksum"}, "1": _healthy()}},
        "w4": None,  # registered, no heartbeat yet
    })
    lines = render_status(st).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("REPLICA PROBLEMS"))
    rows = [line.split(None, 3) for line in lines[start + 1:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [("w1", "1", "failed"), ("w2", "0", "resyncing"),
                                                  ("w3", "0", "corrupt")]
    assert rows[0][3] == "Unappliable: unknown op kind put_item_v2"
    assert rows[2][3] == "wal record 17: bad checksum"


def test_status_says_so_when_no_replica_has_a_problem_and_when_it_cannot_know() -> None:
    healthy = render_status(_with_reports({"w1": {"groups": {"0": _healthy()}}}))
    assert "no replica problems reported" in healthy and "REPLICA PROBLEMS" not in healthy
    # A meta follower's view carries no heartbeat reports: that is "unknown", not "healthy".
    blind = render_status(_with_reports({"w1": ..., "w2": ...}))
    assert "replica health unknown" in blind and "no replica problems" not in blind


def test_status_shows_a_leader_without_quorum_and_replicas_cut_off_from_their_leader() -> None:
    st = _with_reports({
        "w1": {"groups": {"0": {**_healthy(), "role": "leader", "quorum": False, "no_quorum_ms": 2300},
                          "1": {**_healthy(), "leader_silence_ms": 40, "leader": "w2"}}},
        "w2": {"groups": {"0": {**_healthy(), "leader": "w1", "leader_silence_ms": 3800},
                          "1": {**_healthy(), "role": "leader", "quorum": True, "no_quorum_ms": None}}},
        "w3": {"groups": {"0": {**_healthy(), "leader": "w1", "leader_silence_ms": 1499}}},
    })
    st["topology"]["settings"] = {"lease_ms": 1500}
    lines = render_status(st).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("REPLICA PROBLEMS"))
    rows = [line.split(None, 3) for line in lines[start + 1:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [("w1", "0", "no-quorum"), ("w2", "0", "cut-off")]
    assert "no round trip with a majority of its voters for 2300 ms" in rows[0][3]
    assert rows[1][3] == "has not heard from its leader w1 (term 3) for 3800 ms"


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
    assert lines[start + 1:start + 3] == [
        "  group 1: file w1,w2,w3; live w1,w2,w4 (w3 removed: repaired onto w4; "
        "the controller keeps w1,w2,w4 until the file is applied again)",
        "",
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
