"""The contract between a shard group's replication machinery and its state machine.

A *plugin* is the deterministic state machine of one shard group.
The replication layer (worker/replica.py, worker/group.py) owns the log, the
terms, the network and the disk; the plugin owns the meaning of an op. The
replication code only ever talks to the `Plugin` protocol below, so a second
plugin (the torch layer-range model) plugs in by implementing these methods and
adding one line to `_FACTORIES`.

The contract, which every implementation must keep:

* **Determinism.** `apply` is a pure function of (state, op, ctx). Every
  replica applies the same committed ops in the same order and must end in the
  same state, bit for bit: no clock (use `ctx.ts_ms`, the entry's log time),
  no randomness, no I/O, no iteration over anything whose order is not itself
  determined by the ops (e.g. set order, object ids).
* **Atomic apply.** `apply` either applies the whole op or raises (BadOp)
  without changing anything. A committed op that raises is a deterministic
  no-op on every replica; the shell answers the client with the error and
  carries on applying the next entry. Anything else raised from `apply` is a
  bug and the replica must stop applying (it cannot know whether it diverged).
  BadOp is only for what the *state* refuses (an int64 counter that would
  overflow). An op whose *structure* this version does not know (a kind or a
  key only a newer leader's `validate` admits) must raise `Unappliable`: a
  no-op here and an apply on the newer replicas would be a silent divergence
  (a worker upgrade in the wrong order), so the replica stops instead, and
  applies the entry once it runs a version that knows it.
* **Admission vs application.** `validate` runs on the leader *before* an op
  enters the log and enforces admission limits (sizes, id lengths) on top of
  structure. `apply` re-checks only what it needs to stay consistent
  (types, dimension). So a limit changed on one worker cannot make replicas
  diverge: an op admitted by some leader is applied by everyone.
* **Single-threaded.** No method may be called concurrently with another on
  the same instance. `query`, `snapshot` and `capture` see the state after
  the last `apply` that returned. The writer `capture` returns is the one
  exception: it runs on another thread while `apply` goes on, so it must
  only touch what `capture` copied.
* **Results are plain data**: None, bool, int (int64 range), finite float,
  str, list, dict with str keys -- encodable by both msgpack and orjson.
* **Ops are plain data** too: a dict with a "kind" key, straight from the
  log (msgpack). Envelope fields that belong to the replication layer (request
  ids for dedup, timestamps) do not go inside the op: plugins reject unknown
  keys, because an unknown key silently ignored by an older replica and
  honoured by a newer one is a divergence.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping, Protocol, cast, runtime_checkable


class PluginError(Exception):
    """Base of the errors a plugin raises on purpose; `.code` is the wire error code."""

    code = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        # KeyError.__str__ would repr() the message (quotes); keep it readable.
        return self.message


class BadOp(PluginError, ValueError):
    """The op or query is malformed or over a limit. Maps to `bad_request` (400)."""

    code = "bad_request"


class Unappliable(PluginError):
    """A committed op this plugin cannot apply as written: its kind or shape
    is unknown to this version (see "Atomic apply" above). Not a BadOp on
    purpose: the shell must stop the group on this replica, not record a no-op."""


class NotFound(PluginError, KeyError):
    """The thing a query asked for does not exist. Maps to `not_found` (404)."""

    code = "not_found"


class SnapshotError(PluginError, RuntimeError):
    """`restore` was given a snapshot it cannot use (corrupt, other format, other
    dimension). The plugin's state is unchanged; the caller should fetch
    another snapshot."""

    code = "internal"


@dataclass(frozen=True, slots=True)
class ApplyContext:
    """What the log entry says about an op, beyond the op itself.

    `ts_ms` is the group's log time stamped on the entry when it was
    appended: the only notion of time a plugin may use (TTLs, expiry). It
    is ms of leadership carried from leader to leader on their monotonic
    clocks (worker/replica.py, "Log time"): it never goes back and never
    runs faster than real time, and it is NOT a wall clock (it falls behind
    one by every failover gap, and a new group starts at 0).
    """

    seq: int
    term: int
    ts_ms: int


@dataclass(frozen=True, slots=True)
class PluginSettings:
    """Per-group plugin configuration.

    `embedding_dim` is part of the state's shape and must be the same on every
    replica of a group (it comes from the topology's settings and cannot change
    on a live cluster). The two limits are admission limits, enforced by
    `validate` on the leader only.
    """

    embedding_dim: int = 64
    max_item_bytes: int = 1 << 20  # of the doc's JSON (orjson) encoding
    max_id_len: int = 256  # in UTF-8 bytes, for item/entity/embedding ids and signal names
    # The `layers` plugin's: the topology's model dict ({"layers", "d_model",
    # "d_hidden", "seed", ...}) and the inclusive range of layers this group holds.
    model: Mapping[str, Any] | None = None
    layer_range: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        for name in ("embedding_dim", "max_item_bytes", "max_id_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PluginSettings.{name} must be a positive int, got {value!r}")
        if self.model is not None:
            if not isinstance(self.model, Mapping):
                raise ValueError(f"PluginSettings.model must be a mapping, got {type(self.model).__name__}")
            # A read-only copy: the settings are shared and must not change under a plugin.
            object.__setattr__(self, "model", MappingProxyType(dict(self.model)))
        if self.layer_range is not None:
            r = self.layer_range
            if not (isinstance(r, (tuple, list)) and len(r) == 2
                    and all(isinstance(v, int) and not isinstance(v, bool) for v in r) and 0 <= r[0] <= r[1]):
                raise ValueError(f"PluginSettings.layer_range must be (first, last) ints with "
                                 f"0 <= first <= last, got {r!r}")
            layers = self.model.get("layers") if self.model is not None else None
            if isinstance(layers, int) and r[1] >= layers:
                raise ValueError(f"PluginSettings.layer_range {tuple(r)} is beyond the model's "
                                 f"{layers} layers (0..{layers - 1})")
            object.__setattr__(self, "layer_range", (int(r[0]), int(r[1])))


SnapshotWriter = Callable[[Path], None]


@runtime_checkable
class Plugin(Protocol):
    """A shard group's deterministic state machine. See the module docstring."""

    #: The registry name ("entities"); also written into snapshots.
    name: str

    def validate(self, op: dict[str, Any]) -> None:
        """Raise BadOp if `op` must never enter the log.

        Called on the leader before appending. Must not look at or change the
        state (the state at apply time may differ: earlier entries are still in
        flight), must be deterministic and cheap.
        """
        ...

    def apply(self, op: dict[str, Any], ctx: ApplyContext) -> Any:
        """Apply one committed op; return its (plain-data) result for the client.

        Atomic: on BadOp nothing changed. An op of a kind or shape this
        version does not know raises Unappliable. See the module docstring.
        """
        ...

    def weight(self, op: Any) -> int:
        """How many client writes `op` stands for (1 for most ops; a bulk op
        counts its records). The replication layer spaces snapshots and sizes
        catch-up messages by it. A pure function of the op, cheap, and never
        raising, whatever the op (it may be called before validation).
        """
        ...

    def query(self, q: dict[str, Any]) -> Any:
        """Answer a read from the current state. Raises BadOp or NotFound."""
        ...

    def snapshot(self, dir: Path) -> None:
        """Write the full state as files into `dir`, which exists and is empty.

        The plugin only writes its files; making them durable and atomic is
        the caller's job (worker/snapshots.py packs them into one archive and
        fsyncs that), so the plugin's own fsyncs would only write it twice.
        Plugin file names never start with "_": the caller may add its own
        `_*` files (e.g. the applied seq/term) to the same directory. Two
        replicas that applied the same ops must write byte-identical files.
        """
        ...

    def capture(self) -> "SnapshotWriter":
        """Freeze the current state and return a function that writes it as
        `snapshot` would.

        `capture` runs on the event loop and should only copy (references to
        immutable values where it can); the writer does the packing and the
        I/O on another thread, so that a large state does not stall the
        worker's other groups.
        """
        ...

    def snapshot_records(self) -> int:
        """How many records a snapshot would write now, O(1): the shell
        spaces snapshots by it (worker/group.py, snapshot_due). 0 for a
        state whose snapshot costs the same whatever was written."""
        ...

    def restore(self, dir: Path) -> None:
        """Replace the whole state by the one in the snapshot at `dir`.

        Raises SnapshotError and keeps the current state if the snapshot is
        unusable. Ignores files whose names start with "_".
        """
        ...

    def stats(self) -> dict[str, Any]:
        """Counts and approximate bytes; O(1), safe to call on every /metrics scrape."""
        ...


def import_torch() -> Any:
    """torch, imported quietly: without numpy installed (shardgrid needs none)
    torch warns on import that it could not initialise NumPy."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        import torch
    return torch


# name -> "module:factory". Strings, imported on use: the registry stays
# immutable, base.py has no import cycle with the plugins, and a process never
# imports a plugin (or torch) it does not run.
_FACTORIES: Mapping[str, str] = MappingProxyType({
    "entities": "worker.plugins.entities:EntitiesPlugin",
    "layers": "worker.plugins.layers:LayersPlugin",
})


def available_plugins() -> tuple[str, ...]:
    """Names `load_plugin` accepts, sorted."""
    return tuple(sorted(_FACTORIES))


def load_plugin(name: str, settings: PluginSettings | None = None) -> Plugin:
    """A fresh, empty instance of the plugin registered as `name`.

    Raises ValueError for an unknown name.
    """
    target = _FACTORIES.get(name) if isinstance(name, str) else None
    if target is None:
        raise ValueError(f"unknown plugin {name!r}; known: {', '.join(available_plugins())}")
    module_name, _, attr = target.partition(":")
    factory = cast(Callable[[PluginSettings], Plugin], getattr(importlib.import_module(module_name), attr))
    return factory(settings if settings is not None else PluginSettings())
