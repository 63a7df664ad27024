"""Validation of a parsed topology document (plain YAML data) into a `Topology`.

Every problem is collected with the path of its field and raised as one
`TopologyError`; nothing partial is ever returned. Checks that depend on an
invalid field are skipped rather than reported as consequences (a replica is
not "unknown" just because the `workers` list itself was malformed).

Beyond the usual checks (unknown keys, duplicate ids, RF above the workers,
unknown or misplaced leaders, a changed shard count, colliding ports), a
live cluster (`live=`) also refuses a different `cluster` name (the file is
probably for another cluster), a different `plugin` and a different
`settings.embedding_dim` (the data on the workers is laid out for those and
cannot be converted by an apply), and changes to a model's shape, seed or
group ranges.
"""
from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from typing import Any

from topology.address import address_key, parse_address
from topology.errors import FieldError, TopologyError
from topology.model import (
    ACK_MODES,
    FSYNC_MODES,
    PLUGINS,
    SETTINGS_FIELDS,
    GroupSpec,
    MetaNode,
    ModelGroupSpec,
    ModelSpec,
    layer_weight_bytes,
    render_runs,
    uncovered_layers,
    Settings,
    Topology,
    WorkerSpec,
)
from topology.placement import place_groups

MAX_SHARDS = 4096
MAX_ID_LEN = 64
# Settings end up in timers and wire formats of other languages: keep them in int32.
MAX_SETTING_INT = 2**31 - 1

_ID_RE = re.compile(r"[A-Za-z0-9_-]+")
_CLUSTER_RE = re.compile(r"[a-z0-9_-]+")
_ZONE_RE = re.compile(r"[A-Za-z0-9_.-]+")
_VERSION_RE = re.compile(r"[A-Za-z0-9_.+-]+")

TOP_KEYS = ("cluster", "shards", "replication_factor", "plugin", "meta", "workers", "groups", "settings", "models")
TOP_REQUIRED = ("cluster", "shards", "replication_factor", "meta", "workers")
META_KEYS = ("id", "raft", "http")
WORKER_KEYS = ("id", "http", "zone")
WORKER_REQUIRED = ("id", "http")
GROUP_KEYS = ("id", "leader", "replicas")
MODEL_KEYS = ("name", "layers", "d_model", "d_hidden", "seed", "replication_factor", "groups")
MODEL_REQUIRED = ("name", "layers", "d_model", "groups")
MODEL_GROUP_KEYS = ("layers", "replicas", "leader")
MAX_LAYERS = 4096
MAX_WIDTH = 1 << 16
# A weights update is one log entry per group, and a log entry is capped at
# 8 MiB (worker/server.py MAX_WRITE_BYTES); leave room for the envelope.
MAX_GROUP_WEIGHTS_BYTES = 7 << 20
SETTINGS_INTS = ("quorum_timeout_ms", "lease_ms", "deadline_ms", "snapshot_every", "embedding_dim",
                 "replace_after_ms", "assignment_timeout_ms", "rebalance_window_ms", "snapshot_concurrency",
                 "snapshot_rate_mb_s")
# Settings that may be 0 below their range, and what 0 means there (runbook/topology.md says it too).
SETTINGS_ZERO_MEANS = {"snapshot_rate_mb_s": "unlimited",
                       "snapshot_state_ratio": "a snapshot every snapshot_every writes, whatever the state's size"}
SETTINGS_ENUMS = {"ack": ACK_MODES, "fsync": FSYNC_MODES}
# key -> (exclusive lower bound, upper bound, why the lower bound): ratios, not counts.
SETTINGS_FLOATS = {
    "hot_latency_ratio": (1.0, 100.0, "a leader is compared with the median of its group, itself included: "
                                      "at 1 or below every busy leader would count as hot"),
    "hot_worker_threshold": (0.0, 100.0, "a fraction above the mean load (0.5 = 50 % above)"),
    "snapshot_state_ratio": (0.0, 100.0, "writes since the last snapshot per record of the state"),
}
SETTINGS_BOOLS = ("hot_relief",)
# A decision window shorter than a few heartbeats (lease_ms / 5 apart) would
# judge noise, not a trend.
MIN_REBALANCE_WINDOW_MS = 1000


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _type_name(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "list"
    if isinstance(v, dict):
        return "mapping"
    return type(v).__name__


class _Checker:
    """Collects FieldErrors; the `want_*` helpers return None when the value is bad."""

    def __init__(self) -> None:
        self.errors: list[FieldError] = []

    def add(self, path: str, message: str) -> None:
        self.errors.append(FieldError(path, message))

    def keys(self, mapping: dict[Any, Any], path: str, allowed: Sequence[str], required: Sequence[str]) -> None:
        for key in mapping:
            if key not in allowed:
                close = difflib.get_close_matches(str(key), allowed, n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"allowed: {', '.join(allowed)}"
                self.add(_join(path, key), f"unknown key ({hint})")
        for key in required:
            if key not in mapping:
                self.add(_join(path, key), "required key is missing")

    def unique(self, seen: dict[str, str], value: str, path: str, what: str) -> bool:
        """Whether `value` is new in `seen` (recording it at `path`); reports a duplicate otherwise."""
        if value in seen:
            self.add(path, f"duplicate {what} {value!r} (also {seen[value]})")
            return False
        seen[value] = path
        return True

    def want_mapping(self, v: object, path: str) -> dict[Any, Any] | None:
        if isinstance(v, dict):
            return v
        self.add(path, f"expected a mapping, got {_type_name(v)}")
        return None

    def want_list(self, v: object, path: str, what: str) -> list[Any] | None:
        if isinstance(v, list):
            return v
        self.add(path, f"expected a list of {what}, got {_type_name(v)}")
        return None

    def want_str(self, v: object, path: str) -> str | None:
        if isinstance(v, str):
            return v
        hint = ""
        if isinstance(v, bool):
            hint = " (YAML reads yes/no/on/off/true/false as booleans: quote the value)"
        elif isinstance(v, (int, float)):
            hint = " (quote the value)"
        self.add(path, f"expected a string, got {_type_name(v)}{hint}")
        return None

    def want_int(self, v: object, path: str, lo: int, hi: int) -> int | None:
        # bool is a subclass of int in Python; `shards: yes` must not mean 1.
        if not isinstance(v, int) or isinstance(v, bool):
            self.add(path, f"expected an integer, got {_type_name(v)}")
            return None
        if not lo <= v <= hi:
            self.add(path, f"must be between {lo} and {hi}, got {v}")
            return None
        return v

    def want_ratio(self, v: object, path: str, above: float, hi: float, why: str,
                   zero: str | None = None) -> float | None:
        """A number in (above, hi]; also exactly 0 when `zero` says what 0 means."""
        # An integer is a ratio too (`hot_latency_ratio: 3`); a boolean is not.
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v:
            self.add(path, f"expected a number, got {'NaN' if v != v else _type_name(v)}")
            return None
        if zero is not None and v == 0:
            return 0.0
        if not above < v <= hi:
            also = f", or 0 ({zero})" if zero is not None else ""
            self.add(path, f"must be greater than {above:g} and at most {hi:g} ({why}){also}, got {v}")
            return None
        return float(v)

    def want_bool(self, v: object, path: str) -> bool | None:
        if not isinstance(v, bool):
            self.add(path, f"expected true or false, got {_type_name(v)}")
            return None
        return v

    def want_id(self, v: object, path: str) -> str | None:
        s = self.want_str(v, path)
        if s is None:
            return None
        if not s or len(s) > MAX_ID_LEN or not _ID_RE.fullmatch(s):
            self.add(path, f"invalid id {s!r}: use 1 to {MAX_ID_LEN} characters from A-Z a-z 0-9 _ -")
            return None
        return s

    def want_address(self, v: object, path: str) -> str | None:
        s = self.want_str(v, path)
        if s is None:
            return None
        try:
            parse_address(s)
        except ValueError as e:
            self.add(path, str(e))
            return None
        return s

    def want_choice(self, v: object, path: str, choices: Sequence[str]) -> str | None:
        s = self.want_str(v, path)
        if s is None:
            return None
        if s not in choices:
            self.add(path, f"must be one of {', '.join(choices)}, got {s!r}")
            return None
        return s


def build_topology(doc: object, *, live: Topology | None = None) -> Topology:
    """Validate a parsed document; raise TopologyError listing every problem."""
    c = _Checker()
    if not isinstance(doc, dict):
        what = "an empty document" if doc is None else f"a {_type_name(doc)}"
        raise TopologyError([FieldError("", f"the topology must be a mapping at the top level, got {what}")])
    c.keys(doc, "", TOP_KEYS, TOP_REQUIRED)

    cluster = None
    if "cluster" in doc:
        cluster = c.want_str(doc["cluster"], "cluster")
        if cluster is not None and (not cluster or len(cluster) > MAX_ID_LEN or not _CLUSTER_RE.fullmatch(cluster)):
            c.add("cluster", f"invalid cluster name {cluster!r}: use 1 to {MAX_ID_LEN} characters from a-z 0-9 _ -")
            cluster = None
    if live is not None and cluster is not None and cluster != live.cluster:
        c.add("cluster", f"this file is for cluster {cluster!r} but the live cluster is {live.cluster!r}")
    shards = c.want_int(doc["shards"], "shards", 1, MAX_SHARDS) if "shards" in doc else None
    if live is not None and shards is not None and shards != live.shards:
        c.add("shards", f"cannot change from {live.shards} to {shards} on a live cluster: "
                        "resharding is a separate operation")
    plugin = c.want_choice(doc["plugin"], "plugin", PLUGINS) if "plugin" in doc else PLUGINS[0]
    if "plugin" in doc and doc["plugin"] == "layers":
        c.add("plugin", "`layers` is not a plugin for the entity shards: declare the model under `models:` "
                        "(runbook/models.md)")
    if live is not None and plugin is not None and plugin != live.plugin:
        c.add("plugin", f"cannot change from {live.plugin!r} to {plugin!r} on a live cluster")

    addresses = _AddressBook(c)
    meta = _meta_nodes(c, doc["meta"], addresses) if "meta" in doc else None
    workers, n_workers, declared = _workers(c, doc["workers"], addresses) if "workers" in doc else (None, None, None)

    rf = None
    if "replication_factor" in doc:
        rf = c.want_int(doc["replication_factor"], "replication_factor", 1, MAX_SHARDS)
        if rf is not None and n_workers is not None and rf > n_workers:
            c.add("replication_factor", f"{rf} exceeds the number of workers ({n_workers})")
            rf = None

    settings = _settings(c, doc["settings"]) if "settings" in doc else Settings()
    if live is not None and settings is not None and settings.embedding_dim != live.settings.embedding_dim:
        c.add("settings.embedding_dim", f"cannot change from {live.settings.embedding_dim} to "
                                        f"{settings.embedding_dim} on a live cluster")

    groups: tuple[GroupSpec, ...] | None = None
    explicit = "groups" in doc
    if explicit:
        groups = _groups(c, doc["groups"], shards, rf, declared)

    models: tuple[ModelSpec, ...] | None = ()
    if "models" in doc:
        models = _models(c, doc["models"], shards, rf, workers, declared)
    if live is not None and models is not None:
        _check_live_models(c, models, live.models)

    if c.errors:
        raise TopologyError(c.errors)
    # No errors means every field above was parsed; the asserts narrow types.
    assert cluster is not None and shards is not None and rf is not None and plugin is not None
    assert meta is not None and workers is not None and settings is not None and models is not None
    if groups is None:
        groups = place_groups(workers, shards, rf)
    groups = groups + _model_placement(models, workers, doc.get("models") or [])
    return Topology(
        cluster=cluster,
        shards=shards,
        replication_factor=rf,
        plugin=plugin,
        meta=meta,
        workers=workers,
        groups=groups,
        settings=settings,
        groups_explicit=explicit,
        models=models,
    )


class _AddressBook:
    """Reports an address used twice (meta raft, meta http, worker http alike)."""

    def __init__(self, c: _Checker) -> None:
        self._c = c
        self._seen: dict[tuple[str, int], str] = {}

    def claim(self, address: str | None, path: str) -> None:
        if address is None:
            return
        key = address_key(address)
        first = self._seen.get(key)
        if first is not None:
            self._c.add(path, f"address {address} is already used by {first}")
        else:
            self._seen[key] = path


def _meta_nodes(c: _Checker, raw: object, addresses: _AddressBook) -> tuple[MetaNode, ...] | None:
    items = c.want_list(raw, "meta", "meta nodes")
    if items is None:
        return None
    ok = True
    if not items:
        c.add("meta", "at least one meta node is required (three for fault tolerance)")
        ok = False
    elif len(items) % 2 == 0:
        c.add("meta", f"needs an odd number of nodes, got {len(items)}: an even count adds no fault tolerance")
        ok = False
    nodes: list[MetaNode] = []
    seen: dict[str, str] = {}
    for i, item in enumerate(items):
        path = f"meta[{i}]"
        m = c.want_mapping(item, path)
        if m is None:
            ok = False
            continue
        c.keys(m, path, META_KEYS, META_KEYS)
        mid = c.want_id(m["id"], f"{path}.id") if "id" in m else None
        if mid is not None and not c.unique(seen, mid, f"{path}.id", "meta id"):
            ok = False
        raft = c.want_address(m["raft"], f"{path}.raft") if "raft" in m else None
        addresses.claim(raft, f"{path}.raft")
        http = c.want_address(m["http"], f"{path}.http") if "http" in m else None
        addresses.claim(http, f"{path}.http")
        if mid is None or raft is None or http is None:
            ok = False
            continue
        nodes.append(MetaNode(id=mid, raft=raft, http=http))
    return tuple(nodes) if ok else None


def _workers(
    c: _Checker, raw: object, addresses: _AddressBook
) -> tuple[tuple[WorkerSpec, ...] | None, int | None, set[str] | None]:
    """Returns (workers, or None if any is bad; how many distinct workers the file
    declares; their ids, or None when an entry has no usable id so any name might
    be meant)."""
    items = c.want_list(raw, "workers", "workers")
    if items is None:
        return None, None, None
    if not items:
        c.add("workers", "at least one worker is required")
        return None, None, None
    ok = True
    ids_known = True
    specs: list[WorkerSpec] = []
    seen: dict[str, str] = {}
    duplicates = 0
    for i, item in enumerate(items):
        path = f"workers[{i}]"
        w = c.want_mapping(item, path)
        if w is None:
            ok = ids_known = False
            continue
        c.keys(w, path, WORKER_KEYS, WORKER_REQUIRED)
        wid = c.want_id(w["id"], f"{path}.id") if "id" in w else None
        if wid is None:
            ids_known = False
        else:
            if not c.unique(seen, wid, f"{path}.id", "worker id"):
                duplicates += 1
                ok = False
        http = c.want_address(w["http"], f"{path}.http") if "http" in w else None
        addresses.claim(http, f"{path}.http")
        zone: str | None = "default"
        if "zone" in w:
            zone = c.want_str(w["zone"], f"{path}.zone")
            if zone is not None and (not zone or len(zone) > MAX_ID_LEN or not _ZONE_RE.fullmatch(zone)):
                c.add(f"{path}.zone", f"invalid zone {zone!r}: use 1 to {MAX_ID_LEN} characters "
                                      "from A-Z a-z 0-9 _ - .")
                zone = None
        if wid is None or http is None or zone is None:
            ok = False
            continue
        specs.append(WorkerSpec(id=wid, http=http, zone=zone))
    return (tuple(specs) if ok else None), len(items) - duplicates, (set(seen) if ids_known else None)


def _settings(c: _Checker, raw: object) -> Settings | None:
    m = c.want_mapping(raw, "settings")
    if m is None:
        return None
    c.keys(m, "settings", SETTINGS_FIELDS, ())
    values: dict[str, Any] = {}
    ok = True
    for key in SETTINGS_FIELDS:
        if key not in m:
            continue
        path = f"settings.{key}"
        if key in SETTINGS_ENUMS:
            v: Any = c.want_choice(m[key], path, SETTINGS_ENUMS[key])
        elif key in SETTINGS_FLOATS:
            v = c.want_ratio(m[key], path, *SETTINGS_FLOATS[key], zero=SETTINGS_ZERO_MEANS.get(key))
        elif key in SETTINGS_BOOLS:
            v = c.want_bool(m[key], path)
        elif key == "allowed_versions":
            v = _versions(c, m[key], path)
        elif key == "rebalance_window_ms":
            v = c.want_int(m[key], path, MIN_REBALANCE_WINDOW_MS, MAX_SETTING_INT)
        else:
            v = c.want_int(m[key], path, 0 if key in SETTINGS_ZERO_MEANS else 1, MAX_SETTING_INT)
        if v is None:
            ok = False
        values[key] = v
    return Settings(**values) if ok else None


def _versions(c: _Checker, raw: object, path: str) -> tuple[str, ...] | None:
    items = c.want_list(raw, path, "version strings, e.g. [\"0.1.0\"]")
    if items is None:
        return None
    if not all(isinstance(v, str) and 0 < len(v) <= MAX_ID_LEN and _VERSION_RE.fullmatch(v) for v in items):
        c.add(path, "each entry must be a version string such as \"0.1.0\" (letters, digits, . + - _)")
        return None
    return tuple(items)


def _groups(
    c: _Checker, raw: object, shards: int | None, rf: int | None, declared: set[str] | None
) -> tuple[GroupSpec, ...] | None:
    items = c.want_list(raw, "groups", "groups (omit `groups:` for automatic placement)")
    if items is None:
        return None
    ok = True
    specs: list[GroupSpec] = []
    seen: dict[int, str] = {}
    for i, item in enumerate(items):
        path = f"groups[{i}]"
        g = c.want_mapping(item, path)
        if g is None:
            ok = False
            continue
        c.keys(g, path, GROUP_KEYS, GROUP_KEYS)
        gid = c.want_int(g["id"], f"{path}.id", 0, MAX_SHARDS - 1) if "id" in g else None
        if gid is not None:
            if gid in seen:
                c.add(f"{path}.id", f"duplicate group id {gid} (also {seen[gid]})")
                gid = None
            elif shards is not None and gid >= shards:
                c.add(f"{path}.id", f"group id {gid} is out of range: with shards {shards} ids are 0..{shards - 1}")
                seen[gid] = f"{path}.id"
                gid = None
            else:
                seen[gid] = f"{path}.id"
        replicas, replicas_ok = (
            _replicas(c, g["replicas"], f"{path}.replicas", rf, declared) if "replicas" in g else (None, False)
        )
        leader = None
        if "leader" in g:
            leader = c.want_id(g["leader"], f"{path}.leader")
            if leader is not None and declared is not None and leader not in declared:
                c.add(f"{path}.leader", f"unknown worker {leader!r} (not declared in workers)")
                leader = None
            elif leader is not None and replicas is not None and leader not in replicas:
                c.add(f"{path}.leader", f"{leader!r} is not one of the group's replicas ({', '.join(replicas)})")
                leader = None
        if gid is None or replicas is None or not replicas_ok or leader is None:
            ok = False
            continue
        specs.append(GroupSpec(id=gid, leader=leader, replicas=replicas))
    if shards is not None:
        missing = [gid for gid in range(shards) if gid not in seen]
        if missing:
            shown = ", ".join(str(gid) for gid in missing[:20])
            more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
            c.add("groups", f"missing group ids {shown}{more}: when `groups:` is given it must list "
                            f"exactly ids 0..{shards - 1} (or omit it for automatic placement)")
            ok = False
    return tuple(sorted(specs, key=lambda s: s.id)) if ok else None


def _replicas(
    c: _Checker, raw: object, path: str, rf: int | None, declared: set[str] | None
) -> tuple[tuple[str, ...] | None, bool]:
    """Returns (the well-formed worker ids listed, whether the whole list is valid)."""
    items = c.want_list(raw, path, "worker ids")
    if items is None:
        return None, False
    ok = True
    seen: set[str] = set()
    out: list[str] = []
    for j, item in enumerate(items):
        p = f"{path}[{j}]"
        wid = c.want_id(item, p)
        if wid is None:
            ok = False
        elif wid in seen:
            c.add(p, f"duplicate replica {wid!r}")
            ok = False
        else:
            if declared is not None and wid not in declared:
                c.add(p, f"unknown worker {wid!r} (not declared in workers)")
                ok = False
            seen.add(wid)
            out.append(wid)
    if rf is not None and len(items) != rf:
        c.add(path, f"has {len(items)} replicas but replication_factor is {rf}")
        ok = False
    return tuple(out), ok


def _models(c: _Checker, raw: object, shards: int | None, rf: int | None,
            workers: tuple[WorkerSpec, ...] | None, declared: set[str] | None) -> tuple[ModelSpec, ...] | None:
    """The `models:` list; group ids follow the shards' in file order."""
    items = c.want_list(raw, "models", "models")
    if items is None:
        return None
    ok = shards is not None
    next_id = shards or 0
    out: list[ModelSpec] = []
    names: dict[str, str] = {}
    for i, item in enumerate(items):
        path = f"models[{i}]"
        m = c.want_mapping(item, path)
        if m is None:
            ok = False
            continue
        c.keys(m, path, MODEL_KEYS, MODEL_REQUIRED)
        name = c.want_id(m["name"], f"{path}.name") if "name" in m else None
        if name is not None and not c.unique(names, name, f"{path}.name", "model name"):
            name = None
        layers = c.want_int(m["layers"], f"{path}.layers", 1, MAX_LAYERS) if "layers" in m else None
        d_model = c.want_int(m["d_model"], f"{path}.d_model", 1, MAX_WIDTH) if "d_model" in m else None
        d_hidden = c.want_int(m["d_hidden"], f"{path}.d_hidden", 1, MAX_WIDTH) if "d_hidden" in m \
            else (4 * d_model if d_model is not None else None)
        seed = c.want_int(m["seed"], f"{path}.seed", 0, 2**63 - 1) if "seed" in m else 0
        model_rf = rf
        if "replication_factor" in m:
            model_rf = c.want_int(m["replication_factor"], f"{path}.replication_factor", 1, MAX_SHARDS)
            if model_rf is not None and workers is not None and model_rf > len(workers):
                c.add(f"{path}.replication_factor", f"{model_rf} exceeds the number of workers ({len(workers)})")
                model_rf = None
        groups = _model_groups(c, m["groups"], f"{path}.groups", layers, model_rf, declared, next_id) \
            if "groups" in m else None
        if groups is not None:
            next_id += len(groups)
            if layers is not None:
                _check_cover(c, f"{path}.groups", groups, layers)
            if d_model is not None and d_hidden is not None:
                per_layer = layer_weight_bytes(d_model, d_hidden)
                for j, g in enumerate(groups):
                    size = per_layer * (g.last - g.first + 1)
                    if size > MAX_GROUP_WEIGHTS_BYTES:
                        c.add(f"{path}.groups[{j}].layers",
                              f"layers {g.first}-{g.last} hold {size / 2**20:.1f} MiB of weights, more than the "
                              f"{MAX_GROUP_WEIGHTS_BYTES >> 20} MiB one weights update may carry: "
                              "split the range over more groups")
        if None in (name, layers, d_model, d_hidden, seed, model_rf, groups):
            ok = False
            continue
        assert name is not None and layers is not None and d_model is not None and d_hidden is not None
        assert seed is not None and model_rf is not None and groups is not None
        out.append(ModelSpec(name=name, layers=layers, d_model=d_model, d_hidden=d_hidden, seed=seed,
                             replication_factor=model_rf, groups=groups))
    if shards is not None and next_id > MAX_SHARDS:
        c.add("models", f"shards and model groups together number {next_id}, more than {MAX_SHARDS}")
        ok = False
    return tuple(out) if ok else None


def _model_groups(c: _Checker, raw: object, path: str, layers: int | None, rf: int | None,
                  declared: set[str] | None, first_id: int) -> tuple[ModelGroupSpec, ...] | None:
    items = c.want_list(raw, path, "groups, each {layers: [first, last]}")
    if items is None:
        return None
    if not items:
        c.add(path, "a model needs at least one group")
        return None
    ok = True
    out: list[ModelGroupSpec] = []
    for j, item in enumerate(items):
        gpath = f"{path}[{j}]"
        g = c.want_mapping(item, gpath)
        if g is None:
            ok = False
            continue
        c.keys(g, gpath, MODEL_GROUP_KEYS, ("layers",))
        span = _layer_range(c, g["layers"], f"{gpath}.layers", layers) if "layers" in g else None
        replicas: tuple[str, ...] | None = None
        if "replicas" in g:
            replicas, replicas_ok = _replicas(c, g["replicas"], f"{gpath}.replicas", rf, declared)
            if not replicas_ok:
                ok = False
        if "leader" in g:
            leader = c.want_id(g["leader"], f"{gpath}.leader")
            if "replicas" not in g:
                c.add(f"{gpath}.leader", "a leader needs the group's replicas too (or omit both for "
                                         "automatic placement)")
                ok = False
            elif leader is not None and replicas is not None and leader not in replicas:
                c.add(f"{gpath}.leader", f"{leader!r} is not one of the group's replicas ({', '.join(replicas)})")
                ok = False
        if span is None:
            ok = False
            continue
        out.append(ModelGroupSpec(id=first_id + j, first=span[0], last=span[1], pinned="replicas" in g))
    return tuple(out) if ok else None


def _layer_range(c: _Checker, raw: object, path: str, layers: int | None) -> tuple[int, int] | None:
    if not (isinstance(raw, list) and len(raw) == 2):
        c.add(path, f"expected [first, last] (inclusive layer numbers), got {_type_name(raw)}")
        return None
    hi = (layers - 1) if layers is not None else MAX_LAYERS - 1
    first = c.want_int(raw[0], f"{path}[0]", 0, hi)
    last = c.want_int(raw[1], f"{path}[1]", 0, hi)
    if first is None or last is None:
        return None
    if first > last:
        c.add(path, f"first layer {first} is after last layer {last}")
        return None
    return first, last


def _check_cover(c: _Checker, path: str, groups: tuple[ModelGroupSpec, ...], layers: int) -> None:
    gaps = uncovered_layers([(g.first, g.last) for g in groups], layers)
    if gaps:
        c.add(path, f"layers {render_runs(gaps)} are not covered by any group: every layer 0..{layers - 1} "
                    "needs one")


def _check_live_models(c: _Checker, models: tuple[ModelSpec, ...], live: tuple[ModelSpec, ...]) -> None:
    """A live model keeps its shape, seed and layer ranges (the groups hold them,
    and group ids follow from their order); a new model may be appended."""
    for i, old in enumerate(live):
        path = f"models[{i}]"
        new = models[i] if i < len(models) else None
        if new is None:
            c.add("models", f"model {old.name!r} cannot be removed from a live cluster")
            continue
        for key in ("name", "layers", "d_model", "d_hidden", "seed"):
            if getattr(new, key) != getattr(old, key):
                hint = " (change weights with POST /v1/models/NAME/weights)" if key == "seed" else ""
                c.add(f"{path}.{key}", f"cannot change from {getattr(old, key)!r} to {getattr(new, key)!r} "
                                       f"on a live cluster{hint}")
        if [(g.id, g.first, g.last) for g in new.groups] != [(g.id, g.first, g.last) for g in old.groups]:
            c.add(f"{path}.groups", "the layer ranges of a live model's groups cannot change "
                                    f"(live: {render_runs([(g.first, g.last) for g in old.groups])})")


def _model_placement(models: tuple[ModelSpec, ...], workers: tuple[WorkerSpec, ...],
                     raw: list[Any]) -> tuple[GroupSpec, ...]:
    """Each model group's replicas: the file's, or automatic placement over the
    model's own groups (so leaders and replicas spread within the model)."""
    out: list[GroupSpec] = []
    for m, raw_m in zip(models, raw):
        auto = place_groups(workers, len(m.groups), m.replication_factor)
        for j, g in enumerate(m.groups):
            entry = raw_m["groups"][j]
            if "replicas" in entry:
                replicas = tuple(entry["replicas"])
                out.append(GroupSpec(id=g.id, leader=entry.get("leader", replicas[0]), replicas=replicas))
            else:
                out.append(GroupSpec(id=g.id, leader=auto[j].leader, replicas=auto[j].replicas))
    return tuple(out)
