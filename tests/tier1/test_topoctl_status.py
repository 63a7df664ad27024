"""`topoctl status` rendering (the human view of meta's cluster state)."""
from __future__ import annotations

from shardgrid.topoctl import render_status


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
