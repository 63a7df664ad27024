"""Loading and validating topology files (topology/loader.py, topology/validate.py)."""
from __future__ import annotations

import copy
import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from topology.errors import FieldError, TopologyError
from topology.loader import load_topology
from topology.model import GroupSpec, MetaNode, Settings, Topology, WorkerSpec
from topology.placement import place_groups

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def base_doc() -> dict[str, Any]:
    """A valid document with explicit groups; 4 workers so a leader can be a non-replica."""
    return {
        "cluster": "demo",
        "shards": 3,
        "replication_factor": 3,
        "plugin": "entities",
        "meta": [
            {"id": "m1", "raft": "127.0.0.1:7001", "http": "127.0.0.1:7101"},
            {"id": "m2", "raft": "127.0.0.1:7002", "http": "127.0.0.1:7102"},
            {"id": "m3", "raft": "127.0.0.1:7003", "http": "127.0.0.1:7103"},
        ],
        "workers": [
            {"id": "w1", "http": "127.0.0.1:7201", "zone": "a"},
            {"id": "w2", "http": "127.0.0.1:7202", "zone": "b"},
            {"id": "w3", "http": "127.0.0.1:7203", "zone": "c"},
            {"id": "w4", "http": "127.0.0.1:7204", "zone": "a"},
        ],
        "groups": [
            {"id": 0, "leader": "w1", "replicas": ["w1", "w2", "w3"]},
            {"id": 1, "leader": "w2", "replicas": ["w2", "w3", "w4"]},
            {"id": 2, "leader": "w3", "replicas": ["w1", "w3", "w4"]},
        ],
        "settings": {"ack": "quorum", "fsync": "batch"},
    }


def dump(doc: object) -> str:
    return yaml.safe_dump(doc, sort_keys=False)


def mutated(fn: Callable[[dict[str, Any]], None]) -> str:
    doc = base_doc()
    fn(doc)
    return dump(doc)


def setp(path: str, value: object) -> Callable[[dict[str, Any]], None]:
    """Mutator setting a dotted path like "workers.1.http" (list indexes as numbers)."""

    def fn(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return fn


def delp(path: str) -> Callable[[dict[str, Any]], None]:
    def fn(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        del node[int(last) if isinstance(node, list) else last]

    return fn


def live_with(**changes: Any) -> Topology:
    d = load_topology(dump(base_doc())).to_dict()
    for k, v in changes.items():
        if k == "embedding_dim":
            d["settings"]["embedding_dim"] = v
        else:
            d[k] = v
    return Topology.from_dict(d)


# (id, input text or bytes, live topology or None, [(path, message fragment), ...] exactly as reported)
BAD: list[tuple[str, str | bytes, Topology | None, list[tuple[str, str]]]] = [
    ("non-utf8", b"cluster: demo\nshards: \xff\n", None, [("", "not valid UTF-8: byte 0xff at line 2, column 9")]),
    ("yaml-syntax", "cluster: demo\nshards: [1, 2\nworkers: []\n", None, [("", "invalid YAML at line 3, column 8")]),
    ("yaml-bad-indent", "cluster: demo\n  shards: 3\n", None, [("", "invalid YAML at line 2, column 9")]),
    ("yaml-duplicate-key", dump(base_doc()) + "shards: 4\n", None, [("", "found duplicate key 'shards'")]),
    ("top-level-list", "- cluster: demo\n- shards: 3\n", None, [("", "mapping at the top level, got a list")]),
    ("empty-document", "", None, [("", "got an empty document")]),
    ("unknown-top-key", mutated(setp("replicas", 3)), None, [("replicas", "unknown key")]),
    ("misspelled-top-key", mutated(lambda d: d.update(shard=d.pop("shards"))), None,
     [("shard", "did you mean 'shards'?"), ("shards", "required key is missing")]),
    ("missing-cluster", mutated(delp("cluster")), None, [("cluster", "required key is missing")]),
    ("unknown-worker-key", mutated(setp("workers.1.port", 7202)), None, [("workers[1].port", "unknown key")]),
    ("unknown-meta-key", mutated(setp("meta.2.peer", "x")), None, [("meta[2].peer", "unknown key")]),
    ("unknown-group-key", mutated(setp("groups.0.term", 1)), None, [("groups[0].term", "unknown key")]),
    ("missing-worker-http", mutated(delp("workers.3.http")), None, [("workers[3].http", "required key is missing")]),
    ("bool-shards", mutated(setp("shards", True)), None, [("shards", "expected an integer, got boolean")]),
    ("float-shards", mutated(setp("shards", 3.0)), None, [("shards", "expected an integer, got float")]),
    ("zero-shards", mutated(setp("shards", 0)), None, [("shards", "between 1 and 4096, got 0")]),
    ("too-many-shards", mutated(setp("shards", 4097)), None, [("shards", "between 1 and 4096, got 4097")]),
    ("string-rf", mutated(setp("replication_factor", "3")), None,
     [("replication_factor", "expected an integer, got string")]),
    ("rf-above-workers", mutated(setp("replication_factor", 5)), None,
     [("replication_factor", "5 exceeds the number of workers (4)")]),
    ("bad-cluster-name", mutated(setp("cluster", "Demo")), None, [("cluster", "invalid cluster name 'Demo'")]),
    ("unknown-plugin", mutated(setp("plugin", "kv")), None, [("plugin", "must be one of entities, got 'kv'")]),
    ("duplicate-worker-id", mutated(lambda d: d["workers"].append({"id": "w2", "http": "127.0.0.1:7205"})), None,
     [("workers[4].id", "duplicate worker id 'w2' (also workers[1].id)")]),
    ("duplicate-meta-id", mutated(setp("meta.2.id", "m1")), None,
     [("meta[2].id", "duplicate meta id 'm1' (also meta[0].id)")]),
    ("worker-id-bad-chars", mutated(setp("workers.3.id", "w 4")), None, [("workers[3].id", "invalid id 'w 4'")]),
    ("worker-id-too-long", mutated(setp("workers.3.id", "w" * 65)), None, [("workers[3].id", "1 to 64 characters")]),
    ("worker-id-integer", mutated(setp("workers.3.id", 4)), None,
     [("workers[3].id", "expected a string, got integer (quote the value)")]),
    ("zone-yaml-boolean", dump(base_doc()).replace("zone: c", "zone: no"), None,
     [("workers[2].zone", "got boolean (YAML reads yes/no/on/off/true/false as booleans")]),
    ("even-meta-count", mutated(delp("meta.2")), None, [("meta", "odd number of nodes, got 2")]),
    ("no-meta", mutated(setp("meta", [])), None, [("meta", "at least one meta node is required")]),
    ("meta-not-list", mutated(setp("meta", {"id": "m1"})), None, [("meta", "expected a list of meta nodes, got mapping")]),
    ("meta-item-not-mapping", mutated(setp("meta.0", "m1")), None, [("meta[0]", "expected a mapping, got string")]),
    ("no-workers", mutated(setp("workers", [])), None, [("workers", "at least one worker is required")]),
    ("replica-undeclared", mutated(setp("groups.0.replicas.2", "w9")), None,
     [("groups[0].replicas[2]", "unknown worker 'w9' (not declared in workers)")]),
    ("leader-not-replica", mutated(setp("groups.1.leader", "w1")), None,
     [("groups[1].leader", "'w1' is not one of the group's replicas (w2, w3, w4)")]),
    ("leader-undeclared", mutated(setp("groups.0.leader", "w9")), None,
     [("groups[0].leader", "unknown worker 'w9' (not declared in workers)")]),
    ("duplicate-replica", mutated(setp("groups.0.replicas", ["w1", "w1", "w2"])), None,
     [("groups[0].replicas[1]", "duplicate replica 'w1'")]),
    ("wrong-replica-count", mutated(setp("groups.2.replicas", ["w1", "w3"])), None,
     [("groups[2].replicas", "has 2 replicas but replication_factor is 3")]),
    ("duplicate-group-id", mutated(setp("groups.2.id", 0)), None,
     [("groups[2].id", "duplicate group id 0 (also groups[0].id)"), ("groups", "missing group ids 2:")]),
    ("missing-group-id", mutated(delp("groups.1")), None, [("groups", "missing group ids 1: when `groups:`")]),
    ("extra-group-id", mutated(setp("groups.2.id", 3)), None,
     [("groups[2].id", "group id 3 is out of range: with shards 3 ids are 0..2"), ("groups", "missing group ids 2:")]),
    ("bool-group-id", mutated(setp("groups.0.id", False)), None,
     [("groups[0].id", "expected an integer, got boolean"), ("groups", "missing group ids 0:")]),
    ("groups-null", mutated(setp("groups", None)), None, [("groups", "expected a list of groups")]),
    ("worker-http-equals-meta-http", mutated(setp("workers.0.http", "127.0.0.1:7101")), None,
     [("workers[0].http", "address 127.0.0.1:7101 is already used by meta[0].http")]),
    ("meta-http-equals-raft", mutated(setp("meta.1.http", "127.0.0.1:7002")), None,
     [("meta[1].http", "address 127.0.0.1:7002 is already used by meta[1].raft")]),
    ("port-too-large", mutated(setp("workers.1.http", "127.0.0.1:70000")), None,
     [("workers[1].http", "port 70000 in '127.0.0.1:70000' is out of range 1..65535")]),
    ("port-zero", mutated(setp("meta.0.raft", "127.0.0.1:0")), None, [("meta[0].raft", "out of range 1..65535")]),
    ("port-missing", mutated(setp("meta.0.raft", "127.0.0.1")), None, [("meta[0].raft", "is not 'host:port'")]),
    ("port-not-number", mutated(setp("workers.0.http", "127.0.0.1:http")), None,
     [("workers[0].http", "port 'http' in '127.0.0.1:http' is not a number")]),
    ("ipv6-unbracketed", mutated(setp("workers.0.http", "::1:7201")), None,
     [("workers[0].http", "IPv6 is written '[addr]:port'")]),
    ("shards-changed-live", mutated(setp("shards", 4)), live_with(), [
        ("shards", "cannot change from 3 to 4 on a live cluster: resharding is a separate operation"),
        ("groups", "missing group ids 3:"),
    ]),
    ("shards-changed-live-auto", mutated(lambda d: d.update(shards=2) or d.pop("groups")), live_with(),
     [("shards", "cannot change from 3 to 2 on a live cluster")]),
    ("cluster-changed-live", mutated(setp("cluster", "other")), live_with(),
     [("cluster", "this file is for cluster 'other' but the live cluster is 'demo'")]),
    ("plugin-layers-is-a-model", mutated(setp("plugin", "layers")), None,
     [("plugin", "must be one of entities, got 'layers'"),
      ("plugin", "`layers` is not a plugin for the entity shards: declare the model under `models:`")]),
    ("embedding-dim-changed-live", mutated(setp("settings.embedding_dim", 128)), live_with(),
     [("settings.embedding_dim", "cannot change from 64 to 128 on a live cluster")]),
    ("bad-settings-fsync", mutated(setp("settings.fsync", "sometimes")), None,
     [("settings.fsync", "must be one of batch, always, none, got 'sometimes'")]),
    ("bad-settings-ack", mutated(setp("settings.ack", "majority")), None,
     [("settings.ack", "must be one of leader, quorum, all, got 'majority'")]),
    ("unknown-settings-key", mutated(setp("settings.fsynk", "batch")), None,
     [("settings.fsynk", "unknown key (did you mean 'fsync'?)")]),
    ("settings-zero-int", mutated(setp("settings.lease_ms", 0)), None, [("settings.lease_ms", "between 1 and")]),
    ("settings-zero-snapshot-concurrency", mutated(setp("settings.snapshot_concurrency", 0)), None,
     [("settings.snapshot_concurrency", "between 1 and")]),
    ("settings-negative-snapshot-rate", mutated(setp("settings.snapshot_rate_mb_s", -1)), None,
     [("settings.snapshot_rate_mb_s", "between 0 and")]),
    ("settings-string-int", mutated(setp("settings.deadline_ms", "5s")), None,
     [("settings.deadline_ms", "expected an integer, got string")]),
    ("settings-null", mutated(setp("settings", None)), None, [("settings", "expected a mapping, got null")]),
    ("hot-ratio-too-low", mutated(setp("settings.hot_latency_ratio", 1)), None,
     [("settings.hot_latency_ratio", "must be greater than 1 and at most 100 (a leader is compared with the median")]),
    ("hot-ratio-bool", mutated(setp("settings.hot_latency_ratio", True)), None,
     [("settings.hot_latency_ratio", "expected a number, got boolean")]),
    ("snapshot-ratio-negative", mutated(setp("settings.snapshot_state_ratio", -0.5)), None,
     [("settings.snapshot_state_ratio", "must be greater than 0 and at most 100 (writes since the last snapshot "
                                        "per record of the state), or 0 (a snapshot every snapshot_every writes")]),
    ("snapshot-ratio-bool", mutated(setp("settings.snapshot_state_ratio", False)), None,
     [("settings.snapshot_state_ratio", "expected a number, got boolean")]),
    ("snapshot-ratio-string", mutated(setp("settings.snapshot_state_ratio", "half")), None,
     [("settings.snapshot_state_ratio", "expected a number, got string")]),
    ("hot-threshold-zero", mutated(setp("settings.hot_worker_threshold", 0)), None,
     [("settings.hot_worker_threshold", "must be greater than 0 and at most 100")]),
    ("hot-relief-not-bool", mutated(setp("settings.hot_relief", "no")), None,
     [("settings.hot_relief", "expected true or false, got string")]),
    ("rebalance-window-short", mutated(setp("settings.rebalance_window_ms", 200)), None,
     [("settings.rebalance_window_ms", "must be between 1000 and")]),
]
# A case-insensitive host collision, built separately (two mutations).
_collide = base_doc()
_collide["workers"][0]["http"] = "localhost:7201"
_collide["workers"][2]["http"] = "LocalHost:7201"
BAD.append(
    ("worker-http-collide-case", dump(_collide), None,
     [("workers[2].http", "address LocalHost:7201 is already used by workers[0].http")]),
)


@pytest.mark.parametrize(("text", "live", "expected"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_rejects_with_exact_paths(text: str | bytes, live: Topology | None, expected: list[tuple[str, str]]) -> None:
    with pytest.raises(TopologyError) as info:
        load_topology(text, live=live)
    got = [(e.path, e.message) for e in info.value.errors]
    assert [p for p, _ in got] == [p for p, _ in expected], got
    for (_, message), (_, fragment) in zip(got, expected):
        assert fragment in message, (message, fragment)


def test_bad_input_count() -> None:
    assert len({b[0] for b in BAD}) >= 20


def test_every_error_in_one_file_is_reported() -> None:
    doc = base_doc()
    doc["shards"] = True
    doc["workers"][1]["port"] = 1
    doc["workers"].append({"id": "w1", "http": "127.0.0.1:7205"})
    doc["meta"][0]["http"] = "127.0.0.1:7202"
    doc["groups"][0]["leader"] = "w9"
    doc["settings"]["fsync"] = "never"
    with pytest.raises(TopologyError) as info:
        load_topology(dump(doc))
    assert info.value.to_list() == [
        {"path": "shards", "message": "expected an integer, got boolean"},
        {"path": "workers[1].port", "message": "unknown key (allowed: id, http, zone)"},
        {"path": "workers[1].http", "message": "address 127.0.0.1:7202 is already used by meta[0].http"},
        {"path": "workers[4].id", "message": "duplicate worker id 'w1' (also workers[0].id)"},
        {"path": "settings.fsync", "message": "must be one of batch, always, none, got 'never'"},
        {"path": "groups[0].leader", "message": "unknown worker 'w9' (not declared in workers)"},
    ]
    text = str(info.value)
    assert text.splitlines()[0] == "shards: expected an integer, got boolean"
    assert len(text.splitlines()) == 6


def test_error_object() -> None:
    err = TopologyError([FieldError("shards", "bad"), FieldError("", "root problem")])
    assert str(err) == "shards: bad\nroot problem"
    assert isinstance(err, ValueError)
    copy_ = pickle.loads(pickle.dumps(err))
    assert copy_.errors == err.errors and str(copy_) == str(err)
    with pytest.raises(ValueError):
        TopologyError([])


def test_example_file_loads_as_documented() -> None:
    t = load_topology((EXAMPLES / "topology.yaml").read_text())
    assert t.cluster == "demo" and t.shards == 3 and t.replication_factor == 3 and t.plugin == "entities"
    assert t.meta == (
        MetaNode("m1", "127.0.0.1:7001", "127.0.0.1:7101"),
        MetaNode("m2", "127.0.0.1:7002", "127.0.0.1:7102"),
        MetaNode("m3", "127.0.0.1:7003", "127.0.0.1:7103"),
    )
    assert t.workers == (
        WorkerSpec("w1", "127.0.0.1:7201", "a"),
        WorkerSpec("w2", "127.0.0.1:7202", "b"),
        WorkerSpec("w3", "127.0.0.1:7203", "c"),
    )
    assert t.groups == tuple(GroupSpec(i, f"w{i + 1}", ("w1", "w2", "w3")) for i in range(3))
    assert t.groups_explicit is True
    assert t.settings == Settings()
    assert t.worker("w2") == WorkerSpec("w2", "127.0.0.1:7202", "b")
    assert t.worker("w9") is None
    assert t.group(1) == GroupSpec(1, "w2", ("w1", "w2", "w3"))
    assert t.group(3) is None


def test_auto_example_is_placed() -> None:
    t = load_topology((EXAMPLES / "topology-auto.yaml").read_bytes())
    assert t.groups_explicit is False
    assert [w.id for w in t.workers] == ["w1", "w2", "w3", "w4", "w5"]
    assert [g.id for g in t.groups] == list(range(6))
    assert t.groups == place_groups(t.workers, 6, 3)
    zone = {w.id: w.zone for w in t.workers}
    for g in t.groups:
        assert {zone[r] for r in g.replicas} == {"a", "b", "c"}
        assert g.leader in g.replicas


def test_defaults_and_group_order() -> None:
    doc = base_doc()
    del doc["plugin"], doc["settings"]
    del doc["workers"][3]["zone"]
    doc["groups"].reverse()
    t = load_topology(dump(doc))
    assert t.plugin == "entities"
    assert t.settings == Settings("quorum", 2000, 1500, "batch", 5000, 100_000, 64)
    assert t.worker("w4") == WorkerSpec("w4", "127.0.0.1:7204", "default")
    assert [g.id for g in t.groups] == [0, 1, 2]
    # Replicas keep the order the operator wrote.
    assert t.group(2) == GroupSpec(2, "w3", ("w1", "w3", "w4"))


def test_all_settings() -> None:
    doc = base_doc()
    doc["settings"] = {"ack": "all", "quorum_timeout_ms": 10, "lease_ms": 20, "fsync": "always",
                       "deadline_ms": 30, "snapshot_every": 40, "embedding_dim": 50}
    assert load_topology(dump(doc)).settings == Settings("all", 10, 20, "always", 30, 40, 50)


def test_snapshot_limits_default_and_a_zero_rate_means_unlimited() -> None:
    doc = base_doc()
    assert (load_topology(dump(doc)).settings.snapshot_concurrency,
            load_topology(dump(doc)).settings.snapshot_rate_mb_s) == (2, 64)
    doc["settings"] = {"snapshot_concurrency": 5, "snapshot_rate_mb_s": 0}
    s = load_topology(dump(doc)).settings
    assert (s.snapshot_concurrency, s.snapshot_rate_mb_s) == (5, 0)



def test_balancing_settings() -> None:
    doc = base_doc()
    doc["settings"] = {"rebalance_window_ms": 2500, "hot_latency_ratio": 3, "hot_worker_threshold": 0.25,
                       "hot_relief": False}
    s = load_topology(dump(doc)).settings
    assert (s.rebalance_window_ms, s.hot_latency_ratio, s.hot_worker_threshold, s.hot_relief) == (2500, 3.0, 0.25, False)
    assert isinstance(s.hot_latency_ratio, float)
    d = Settings()
    assert (d.rebalance_window_ms, d.hot_latency_ratio, d.hot_worker_threshold, d.hot_relief) == (30_000, 2.0, 0.5, True)


def test_accepted_spellings() -> None:
    doc = base_doc()
    doc["workers"][0]["http"] = "[::1]:7201"
    doc["workers"][1]["http"] = "[0:0:0:0:0:0:0:1]:7202"  # same host, other port: fine
    doc["workers"][2]["http"] = "node-3.example.internal:7203"
    doc["workers"][3]["zone"] = "eu-west-1.a"
    doc["cluster"] = "prod_eu-1"
    t = load_topology("\ufeff" + dump(doc))  # a UTF-8 BOM is harmless
    assert t.worker("w1").http == "[::1]:7201"  # type: ignore[union-attr]
    assert t.cluster == "prod_eu-1"


def test_ipv6_collision_uses_canonical_form() -> None:
    doc = base_doc()
    doc["workers"][0]["http"] = "[::1]:7201"
    doc["workers"][1]["http"] = "[0:0:0:0:0:0:0:1]:7201"
    with pytest.raises(TopologyError) as info:
        load_topology(dump(doc))
    assert [e.path for e in info.value.errors] == ["workers[1].http"]


def test_yaml_merge_keys_may_be_overridden() -> None:
    text = dump(base_doc()).replace("settings:\n  ack: quorum\n", "settings:\n  <<: {ack: all, lease_ms: 7}\n  ack: leader\n")
    t = load_topology(text)
    assert (t.settings.ack, t.settings.lease_ms, t.settings.fsync) == ("leader", 7, "batch")


def test_live_with_same_shards_is_accepted() -> None:
    live = live_with()
    doc = base_doc()
    doc["groups"][1]["leader"] = "w4"
    t = load_topology(dump(doc), live=live)
    assert t.group(1).leader == "w4"  # type: ignore[union-attr]


def test_rejects_non_text() -> None:
    with pytest.raises(TypeError):
        load_topology(123)  # type: ignore[arg-type]


def test_to_dict_is_plain_data_and_round_trips() -> None:
    t = load_topology(dump(base_doc()))
    d = t.to_dict()
    assert d["groups"][1] == {"id": 1, "leader": "w2", "replicas": ["w2", "w3", "w4"]}
    assert d["settings"]["embedding_dim"] == 64 and d["groups_explicit"] is True
    assert Topology.from_dict(d) == t
    assert Topology.from_dict(json.loads(json.dumps(d))) == t
    assert Topology.from_dict(msgpack.unpackb(msgpack.packb(d))) == t
    assert Topology.from_dict(copy.deepcopy(d)).to_dict() == d
    # Frozen: a topology is shared between tasks and never edited in place.
    with pytest.raises(AttributeError):
        t.shards = 4  # type: ignore[misc]
    assert hash(t) == hash(Topology.from_dict(d))


@st.composite
def valid_docs(draw: st.DrawFn) -> tuple[dict[str, Any], Topology]:
    n_workers = draw(st.integers(1, 7))
    zones = draw(st.lists(st.sampled_from(["a", "b", "c", "z-1"]), min_size=n_workers, max_size=n_workers))
    shards = draw(st.integers(1, 20))
    rf = draw(st.integers(1, n_workers))
    n_meta = draw(st.sampled_from([1, 3, 5]))
    explicit = draw(st.booleans())
    meta = tuple(MetaNode(f"m{i}", f"10.0.0.{i}:7001", f"10.0.0.{i}:7101") for i in range(n_meta))
    workers = tuple(WorkerSpec(f"w{i}", f"10.0.1.{i}:7201", zones[i]) for i in range(n_workers))
    s = Settings(
        ack=draw(st.sampled_from(["leader", "quorum", "all"])),
        fsync=draw(st.sampled_from(["batch", "always", "none"])),
        lease_ms=draw(st.integers(1, 10**6)),
        embedding_dim=draw(st.integers(1, 4096)),
    )
    groups = place_groups(workers, shards, rf)
    if explicit:
        # Any replica may lead, and the file may list groups in any order.
        groups = tuple(GroupSpec(g.id, g.replicas[draw(st.integers(0, rf - 1))], g.replicas) for g in groups)
        file_order = draw(st.permutations(list(groups)))
    plugin = "entities"
    doc: dict[str, Any] = {
        "cluster": "c-1", "shards": shards, "replication_factor": rf, "plugin": plugin,
        "meta": [{"id": m.id, "raft": m.raft, "http": m.http} for m in meta],
        "workers": [{"id": w.id, "http": w.http, "zone": w.zone} for w in workers],
        "settings": {"ack": s.ack, "fsync": s.fsync, "lease_ms": s.lease_ms, "embedding_dim": s.embedding_dim},
    }
    if explicit:
        doc["groups"] = [{"id": g.id, "leader": g.leader, "replicas": list(g.replicas)} for g in file_order]
    expected = Topology("c-1", shards, rf, plugin, meta, workers, groups, s, explicit)
    return doc, expected


@settings(max_examples=60, deadline=None)
@given(valid_docs())
def test_valid_documents_load_exactly_and_round_trip(case: tuple[dict[str, Any], Topology]) -> None:
    doc, expected = case
    t = load_topology(dump(doc))
    assert t == expected
    assert Topology.from_dict(t.to_dict()) == t
    assert Topology.from_dict(msgpack.unpackb(msgpack.packb(t.to_dict()))) == t
    # Loading against itself as the live topology changes nothing.
    assert load_topology(json.dumps(doc), live=t) == t


@pytest.mark.parametrize("text", ["[" * 3000, "a:\n" + "".join(" " * i + "- \n" for i in range(1, 2000)),
                                  "{a: " * 3000])
def test_a_document_nested_past_the_parsers_stack_is_a_topology_error(text: str) -> None:
    # Found by tests/tier1/test_fuzz_meta.py: PyYAML's RecursionError became a 500 on PUT /v1/topology.
    with pytest.raises(TopologyError, match="invalid YAML"):
        load_topology(text)


@pytest.mark.parametrize("raw, want", [(0, 0.0), (0.0, 0.0), (0.5, 0.5), (2, 2.0)])
def test_snapshot_state_ratio(raw: Any, want: float) -> None:
    doc = base_doc()
    doc["settings"] = {"snapshot_state_ratio": raw}
    s = load_topology(dump(doc)).settings
    assert s.snapshot_state_ratio == want and isinstance(s.snapshot_state_ratio, float)
    assert Settings().snapshot_state_ratio == 0.5
