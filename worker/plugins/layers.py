"""`layers`: a shard group that holds a range of a model's layers.

The group's state is one version of the weights of layers first..last (its
`PluginSettings.layer_range`) of the model described by
`PluginSettings.model`. Version 1 is generated from the model's seed; the
log replaces it by newer versions. The math (and why it is bit-exact across
splits and batches) is in layers_model.py; inference calls `current()` and
runs `.forward` on the immutable `Weights` it returns, off the event loop,
while apply may swap in another one.

Ops:

    {"kind": "set_weights", "version": v, "seed": s}
        generate layers first..last from seed s (0..2**63-1)
    {"kind": "set_weights", "version": v, "weights": bytes}
        a weights file (layers_model.py) holding exactly layers first..last

    -> {"version": v, "first": first, "last": last}

A version newer than the current one replaces it. The current version again
with the same source (seed, or weights file bytes; compared by digest) is a
retry and changes nothing; any other version is refused (BadOp) and the state
stays as it was. Versions only move forward, so two updates racing through
different gateways end in the same state on every replica whatever they were
told.

Queries: {"kind": "info"} -> {"version", "first", "last", "layers", "d_model", "d_hidden"}.

Snapshot: one file `weights.msgpack`, a msgpack map {"version", "source",
"file": the weights file of the current layers}.

torch is imported on first use (layers_model imports it), never by importing
this module: a worker that runs only `entities` groups never pays for it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable

import msgpack
import xxhash

from shardgrid.common.wire import short_repr
from worker.plugins.base import ApplyContext, BadOp, PluginSettings, SnapshotError, SnapshotWriter, Unappliable

if TYPE_CHECKING:
    from worker.plugins.layers_model import ModelConfig, Weights

STATE_FILE = "weights.msgpack"
VERSION_MAX = 2**63 - 1
SEED_MAX = 2**63 - 1
_SET_KEYS = {"seed": frozenset({"kind", "version", "seed"}), "weights": frozenset({"kind", "version", "weights"})}
_SNAPSHOT_KEYS = frozenset({"version", "source", "file"})


def _model() -> ModuleType:
    """layers_model, imported on first use: it imports torch, which costs seconds."""
    from worker.plugins import layers_model

    return layers_model


def _tname(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _seed_source(seed: int) -> str:
    return "seed:" + xxhash.xxh3_128_hexdigest(str(seed).encode())


def _file_source(raw: bytes) -> str:
    return "file:" + xxhash.xxh3_128_hexdigest(raw)


@dataclass(frozen=True, slots=True)
class _SetWeights:
    version: int
    seed: int | None
    raw: bytes | None
    source: str


@dataclass(frozen=True, slots=True)
class _State:
    """The current version. `weights` is None until first needed when it is
    generated from `seed` (a pure function of it, so building it late is
    the same as building it at apply)."""

    version: int
    source: str
    seed: int | None
    weights: "Weights | None"


class LayersPlugin:
    """A range of a model's layers, one weights version at a time. Implements `Plugin`."""

    name = "layers"

    def __init__(self, settings: PluginSettings) -> None:
        if settings.model is None or settings.layer_range is None:
            raise ValueError("the layers plugin needs PluginSettings.model and PluginSettings.layer_range")
        self.settings = settings
        self.cfg: ModelConfig = _model().ModelConfig.from_dict(settings.model)
        first, last = settings.layer_range
        if not 0 <= first <= last < self.cfg.layers:
            raise ValueError(f"layer_range {first}..{last} is not within the model's 0..{self.cfg.layers - 1}")
        self.first, self.last = first, last
        self._state = _State(1, _seed_source(self.cfg.seed), self.cfg.seed, None)

    # -- ops

    def validate(self, op: dict[str, Any]) -> None:
        parsed = self._parse(op)
        if parsed.raw is not None:
            # Here too, not only at apply: a file for another range must never enter the log.
            self._decode(parsed.raw)

    def apply(self, op: dict[str, Any], ctx: ApplyContext) -> Any:
        try:
            parsed = self._parse(op)
        except BadOp as exc:
            # A leader admitted it, so a newer version wrote it (base.py, "Atomic apply").
            raise Unappliable(f"a committed op this version of the layers plugin cannot apply: "
                              f"{exc.message}") from None
        s = self._state
        result = {"version": parsed.version, "first": self.first, "last": self.last}
        if parsed.version == s.version and parsed.source == s.source:
            return result  # a retry of the update that made this version
        if parsed.version <= s.version:
            same = " with other weights" if parsed.version == s.version else ""
            raise BadOp(f"set_weights: the current version is {s.version}; version {parsed.version}{same} "
                        f"is refused (versions only move forward)")
        if parsed.raw is not None:
            try:
                layers = self._decode(parsed.raw)
            except BadOp as exc:
                # validate decoded it on the leader with the same range and model:
                # only another version's validate could have admitted it.
                raise Unappliable(f"a committed set_weights this version of the layers plugin "
                                  f"cannot decode: {exc.message}") from None
            weights = _model().Weights.build(self.cfg, parsed.version, self.first, self.last, layers)
            self._state = _State(parsed.version, parsed.source, None, weights)
        else:
            self._state = _State(parsed.version, parsed.source, parsed.seed, None)
        return result

    def weight(self, op: Any) -> int:
        return 1

    def _parse(self, op: Any) -> _SetWeights:
        if not isinstance(op, dict):
            raise BadOp(f"write op must be an object (dict), got {_tname(op)}")
        kind = op.get("kind")
        if kind != "set_weights":
            if kind == "info":
                raise BadOp("'info' is a query, not a write op")
            raise BadOp(f"unknown write op kind {short_repr(kind)}; expected: set_weights")
        if "seed" in op and "weights" in op:
            raise BadOp("set_weights: give either 'seed' or 'weights', not both")
        if "version" not in op:
            raise BadOp("set_weights: missing 'version'")
        source_key = "weights" if "weights" in op else "seed"
        if source_key not in op:
            raise BadOp("set_weights: missing 'seed' or 'weights'")
        extra = sorted(short_repr(k) for k in op if k not in _SET_KEYS[source_key])
        if extra:
            raise BadOp(f"set_weights: unexpected key(s) {', '.join(extra)}; "
                        f"allowed: kind, version and one of seed, weights")
        version = op["version"]
        if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= VERSION_MAX:
            raise BadOp(f"set_weights: version must be an int in 1..2**63-1, got {short_repr(version)}")
        if source_key == "seed":
            seed = op["seed"]
            if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
                raise BadOp(f"set_weights: seed must be an int in 0..2**63-1, got {short_repr(seed)}")
            return _SetWeights(version, seed, None, _seed_source(seed))
        raw = op["weights"]
        if not isinstance(raw, bytes):
            raise BadOp(f"set_weights: weights must be bytes (a weights file), got {_tname(raw)}")
        return _SetWeights(version, None, raw, _file_source(raw))

    def _decode(self, raw: bytes) -> dict[int, Any]:
        try:
            return _model().decode_layers(raw, self.cfg, self.first, self.last)  # type: ignore[no-any-return]
        except ValueError as exc:
            raise BadOp(f"set_weights: {exc}") from None

    # -- reads

    def current(self) -> "Weights":
        """The weights in use: immutable, so a caller may run it on another thread
        while apply replaces the plugin's."""
        s = self._state
        if s.weights is None:
            assert s.seed is not None
            s = self._state = _State(s.version, s.source, None, self._generate(s.version, s.seed))
        assert s.weights is not None
        return s.weights

    @property
    def loaded(self) -> bool:
        """Whether the weights in use are built (in memory), or still to be generated."""
        return self._state.weights is not None

    def pending_build(self) -> tuple[object, Callable[[], "Weights"]] | None:
        """(token, build) when the weights in use are not built yet: `build`
        may run on another thread (it reads only the immutable config and the
        token's seed); `install_built(token, weights)` then adopts them on the
        plugin's own thread, unless an apply replaced the state meanwhile."""
        s = self._state
        if s.weights is not None or s.seed is None:
            return None
        seed, version = s.seed, s.version
        return s, lambda: self._generate(version, seed)

    def install_built(self, token: object, weights: "Weights") -> bool:
        s = self._state
        if s is not token:
            return False  # an apply came first: these weights are of a replaced version
        self._state = _State(s.version, s.source, None, weights)
        return True

    def _generate(self, version: int, seed: int) -> "Weights":
        lm = _model()
        layers = lm.generate_layers(self.cfg, seed, self.first, self.last)
        return lm.Weights.build(self.cfg, version, self.first, self.last, layers)  # type: ignore[no-any-return]

    def query(self, q: dict[str, Any]) -> Any:
        if not isinstance(q, dict):
            raise BadOp(f"query must be an object (dict), got {_tname(q)}")
        kind = q.get("kind")
        if kind == "set_weights":
            raise BadOp("'set_weights' is a write op, not a query")
        if kind != "info":
            raise BadOp(f"unknown query kind {short_repr(kind)}; expected: info")
        extra = sorted(short_repr(k) for k in q if k != "kind")
        if extra:
            raise BadOp(f"info: unexpected key(s) {', '.join(extra)}")
        c = self.cfg
        return {"version": self._state.version, "first": self.first, "last": self.last,
                "layers": c.layers, "d_model": c.d_model, "d_hidden": c.d_hidden}

    def stats(self) -> dict[str, Any]:
        return {"version": self._state.version, "first": self.first, "last": self.last,
                "bytes": (self.last - self.first + 1) * self.cfg.layer_bytes()}

    # -- snapshots

    def snapshot_records(self) -> int:
        return 0  # the weights of its layers, whatever was written

    def snapshot(self, dir: Path) -> None:
        self.capture()(dir)

    def capture(self) -> SnapshotWriter:
        # Only references: the state and its Weights are immutable. Generating
        # not-yet-built weights and encoding happen in the writer, off the loop.
        s = self._state
        cfg, first, last = self.cfg, self.first, self.last
        generate = self._generate

        def write(dir: Path) -> None:
            lm = _model()
            weights = s.weights
            if weights is None:
                assert s.seed is not None
                weights = generate(s.version, s.seed)
            file = lm.encode_layers(cfg, weights.layers)
            assert weights.first == first and weights.last == last
            doc = msgpack.packb({"version": s.version, "source": s.source, "file": file}, use_bin_type=True)
            with open(Path(dir) / STATE_FILE, "xb") as f:  # "x": the caller promised an empty dir
                f.write(doc)  # no fsync: the caller makes the snapshot durable (base.Plugin.snapshot)

        return write

    def restore(self, dir: Path) -> None:
        path = Path(dir) / STATE_FILE
        try:
            state = self._load(path)
        except SnapshotError:
            raise
        except (OSError, ValueError, TypeError, msgpack.UnpackException) as e:
            raise SnapshotError(f"cannot restore layers snapshot from {path}: {type(e).__name__}: {e}") from e
        self._state = state  # only now: a failed restore leaves the old state

    def _load(self, path: Path) -> _State:
        doc = msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=True)
        if not isinstance(doc, dict) or set(doc) != _SNAPSHOT_KEYS:
            raise SnapshotError(f"{path} is not a layers snapshot (expected a map of version, source, file)")
        version, source, file = doc["version"], doc["source"], doc["file"]
        if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= VERSION_MAX:
            raise SnapshotError(f"{path}: bad version {short_repr(version)}")
        if not isinstance(source, str) or not isinstance(file, bytes):
            raise SnapshotError(f"{path}: source must be a str and file bytes")
        lm = _model()
        try:
            layers = lm.decode_layers(file, self.cfg, self.first, self.last)
        except ValueError as e:
            raise SnapshotError(f"{path} does not hold this group's layers {self.first}..{self.last}: {e}") from e
        return _State(version, source, None, lm.Weights.build(self.cfg, version, self.first, self.last, layers))
