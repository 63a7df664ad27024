"""The topology model: immutable, validated-once data shared by every process.

Instances are built by `topology.loader.load_topology` (which validates) or
by `Topology.from_dict` (which trusts data that came out of `to_dict`, e.g.
the copy replicated by the metadata service).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from functools import cached_property
from typing import Any, Iterable, Mapping

ACK_MODES = ("leader", "quorum", "all")
FSYNC_MODES = ("batch", "always", "none")
# The format tag of a model's weights file (uploads and a group's snapshot alike).
WEIGHTS_FORMAT = "shardgrid-weights/1"
# The most rows one inference request carries (gateway, workers and bench alike).
MAX_INFER_ROWS = 1024


def layer_weight_bytes(d_model: int, d_hidden: int) -> int:
    """Bytes of one layer's float32 tensors: w1, w2 (d_hidden x d_model), b1 (d_hidden), b2 and gain (d_model)."""
    return 4 * (2 * d_model * d_hidden + d_hidden + 2 * d_model)


def uncovered_layers(spans: Iterable[tuple[int, int]], layers: int, start: int = 0) -> list[tuple[int, int]]:
    """The inclusive runs of layers start..layers-1 that no (first, last) span covers."""
    covered = [False] * layers
    for first, last in spans:
        for i in range(max(first, start), min(last, layers - 1) + 1):
            covered[i] = True
    runs: list[tuple[int, int]] = []
    for i in range(start, layers):
        if covered[i]:
            continue
        if runs and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def render_runs(runs: Iterable[tuple[int, int]]) -> str:
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


# The plugin of the entity shards; a model's groups always run `layers`.
PLUGINS = ("entities",)


@dataclass(frozen=True)
class MetaNode:
    id: str
    raft: str  # "host:port"
    http: str  # "host:port"


@dataclass(frozen=True)
class WorkerSpec:
    id: str
    http: str  # "host:port"
    zone: str = "default"


@dataclass(frozen=True)
class GroupSpec:
    id: int
    leader: str
    replicas: tuple[str, ...]


@dataclass(frozen=True)
class ModelGroupSpec:
    """One group of a model: the inclusive layer range its replicas hold."""

    id: int
    first: int
    last: int
    pinned: bool  # the file named its replicas: the controller's balancing leaves its leader alone


@dataclass(frozen=True)
class ModelSpec:
    """A layer-sharded model (the `layers` plugin): its shape and the groups
    holding its layer ranges. Group ids follow the entity shards' (S, S+1, ...)
    in the order of the file."""

    name: str
    layers: int
    d_model: int
    d_hidden: int
    seed: int  # the weights every group starts from (version 1)
    replication_factor: int
    groups: tuple[ModelGroupSpec, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "layers": self.layers, "d_model": self.d_model, "d_hidden": self.d_hidden,
                "seed": self.seed, "replication_factor": self.replication_factor,
                "groups": [asdict(g) for g in self.groups]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelSpec:
        return cls(name=d["name"], layers=d["layers"], d_model=d["d_model"], d_hidden=d["d_hidden"],
                   seed=d["seed"], replication_factor=d["replication_factor"],
                   groups=tuple(ModelGroupSpec(id=g["id"], first=g["first"], last=g["last"],
                                               pinned=g["pinned"]) for g in d["groups"]))


def model_groups(topo: Mapping[str, Any] | None) -> dict[int, tuple[dict[str, Any], dict[str, Any]]]:
    """{group id: (model dict, group dict)} of a stored topology (`to_dict`
    form): what the worker, gateway and meta, which keep the dict, need to
    tell a model's group from an entity shard."""
    out: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
    for m in (topo or {}).get("models") or ():
        for g in m["groups"]:
            out[int(g["id"])] = (m, g)
    return out


def replication_factors(topo: Mapping[str, Any]) -> dict[int, int]:
    """{group id: replication factor} for the model groups, whose factor may
    differ from the topology's (the entity shards use `replication_factor`)."""
    return {gid: int(m["replication_factor"]) for gid, (m, _) in model_groups(topo).items()}


@dataclass(frozen=True)
class Settings:
    ack: str = "quorum"  # leader | quorum | all
    quorum_timeout_ms: int = 2000
    lease_ms: int = 1500
    fsync: str = "batch"  # batch | always | none
    deadline_ms: int = 5000  # default request deadline at gateways
    snapshot_every: int = 100_000  # entries between plugin snapshots (etcd's snapshot-count default)
    embedding_dim: int = 64  # fixed per cluster
    # A voter silent this long is replaced by another worker (meta/repair.py).
    replace_after_ms: int = 60_000
    # A replica the controller assigned that has not caught up this long is
    # cancelled and placed on another worker (meta/repair.py).
    assignment_timeout_ms: int = 300_000
    # Snapshot downloads a worker serves at once (a learner beyond it is told
    # to come back later), and the MB/s of snapshot data it sends, shared by
    # them (0 = unlimited): moving replicas must not starve replication.
    snapshot_concurrency: int = 2
    snapshot_rate_mb_s: int = 64
    # Balancing (meta/hotspot.py, meta/balance.py): how long a hot condition
    # must hold before a move, and how long a moved group is then left alone.
    rebalance_window_ms: int = 30_000
    # A leader is hot when its persist p99 exceeds this times its group's median.
    hot_latency_ratio: float = 2.0
    # A worker sheds a replica when its load exceeds the mean by this fraction.
    hot_worker_threshold: float = 0.5
    hot_relief: bool = True  # false: no hot-leader moves and no shedding
    # The shardgrid versions meta admits workers at (empty: any); a rolling
    # upgrade lists the old and the new one.
    allowed_versions: tuple[str, ...] = ()
    # A large state waits for writes of this many times its records before
    # its next snapshot (worker/group.py snapshot_due); 0: every snapshot_every.
    snapshot_state_ratio: float = 0.5


SETTINGS_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Settings))


@dataclass(frozen=True)
class Topology:
    cluster: str
    shards: int
    replication_factor: int
    plugin: str
    meta: tuple[MetaNode, ...]
    workers: tuple[WorkerSpec, ...]
    groups: tuple[GroupSpec, ...]  # always filled, sorted by id
    settings: Settings
    groups_explicit: bool  # True when the file had `groups:`
    models: tuple[ModelSpec, ...] = ()

    # Lookups sit on request paths (gateway, worker); index once per instance.
    # cached_property writes to __dict__ directly, so it works on a frozen
    # dataclass and stays out of eq/hash/repr/to_dict.
    @cached_property
    def _workers_by_id(self) -> dict[str, WorkerSpec]:
        return {w.id: w for w in self.workers}

    @cached_property
    def _groups_by_id(self) -> dict[int, GroupSpec]:
        return {g.id: g for g in self.groups}

    @cached_property
    def _model_groups(self) -> dict[int, tuple[ModelSpec, ModelGroupSpec]]:
        return {g.id: (m, g) for m in self.models for g in m.groups}

    def model_group(self, gid: int) -> tuple[ModelSpec, ModelGroupSpec] | None:
        """The model and layer range group `gid` holds; None for an entity shard."""
        return self._model_groups.get(gid)

    def model(self, name: str) -> ModelSpec | None:
        return next((m for m in self.models if m.name == name), None)

    def pinned(self, gid: int) -> bool:
        """Whether the file placed group `gid` itself (its leader is then left where the file says)."""
        mg = self._model_groups.get(gid)
        return mg[1].pinned if mg is not None else self.groups_explicit

    def worker(self, wid: str) -> WorkerSpec | None:
        return self._workers_by_id.get(wid)

    def group(self, gid: int) -> GroupSpec | None:
        return self._groups_by_id.get(gid)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (str, int, bool, lists, dicts): JSON- and msgpack-able."""
        return {
            "cluster": self.cluster,
            "shards": self.shards,
            "replication_factor": self.replication_factor,
            "plugin": self.plugin,
            "meta": [asdict(m) for m in self.meta],
            "workers": [asdict(w) for w in self.workers],
            "groups": [{"id": g.id, "leader": g.leader, "replicas": list(g.replicas)} for g in self.groups],
            "settings": asdict(self.settings),
            "groups_explicit": self.groups_explicit,
            "models": [m.to_dict() for m in self.models],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Topology:
        """Inverse of `to_dict`. Does not re-validate: use the loader for input."""
        return cls(
            cluster=d["cluster"],
            shards=d["shards"],
            replication_factor=d["replication_factor"],
            plugin=d["plugin"],
            meta=tuple(MetaNode(id=m["id"], raft=m["raft"], http=m["http"]) for m in d["meta"]),
            workers=tuple(WorkerSpec(id=w["id"], http=w["http"], zone=w["zone"]) for w in d["workers"]),
            groups=tuple(
                GroupSpec(id=g["id"], leader=g["leader"], replicas=tuple(g["replicas"])) for g in d["groups"]
            ),
            # Settings missing from an older stored copy take their defaults.
            settings=Settings(**{**d["settings"],
                                 "allowed_versions": tuple(d["settings"].get("allowed_versions", ()))}),
            groups_explicit=d["groups_explicit"],
            models=tuple(ModelSpec.from_dict(m) for m in d.get("models") or ()),
        )
