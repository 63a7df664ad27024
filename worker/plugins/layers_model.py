"""The `layers` plugin's model: a deterministic stack of residual MLP blocks (pure math, CPU).

Layer i is

    y = x + (relu(rmsnorm(x) @ w1.T + b1) @ w2.T + b2)
    rmsnorm(x) = x / sqrt(mean(x * x) + eps) * gain

with x and y float32 [rows, d_model]. A cluster runs the same layers split
across processes (group A holds 0..11, group B 12..23), with the rows of
several requests concatenated into one forward pass of whatever batch size
came along, and its output must equal the one-process run (`run_model`) byte
for byte. float32 arithmetic on CPU does not give that:

* a float32 matmul is not batch-invariant: a different number of rows picks a
  different kernel and a different order of summation, so a row's result
  depends on the rows it was batched with;
* torch's vectorised elementwise kernels handle a tensor's tail with scalar
  code, and transcendentals (gelu, tanh, exp) are approximated differently by
  the two, so a value's last bit can depend on its position in the tensor.

So inside a layer everything is float64 and the layer's output is rounded to
float32. A float32 x float32 product is exact in float64, and a different
summation order changes a float64 sum by ~1e-16 relative, which the rounding
to float32 (~6e-8) absorbs: it could only show if the float64 value fell
within that distance of a float32 rounding boundary (odds of roughly 1e-9 per
value). The only nonlinearity is ReLU, and the norm uses sqrt and division,
which IEEE rounds exactly in vector and scalar code alike.

Weights are generated per (seed, layer) from a torch.Generator seeded by
xxh3_64(f"{seed}:{i}"), so a group holding layers 8..17 generates exactly the
tensors the full model has there without generating 0..7. They are drawn as
integers (`randint`, no floating point inside the generator) and mapped to a
uniform distribution with unit variance by exact float64 arithmetic, not by
`randn`, whose Box-Muller transform uses vectorised log/sin/cos that may
differ in the last bit between CPU types: every replica must build the same
weights.

Weights file (snapshots and uploads alike): a msgpack map

    {"format": "shardgrid-weights/1", "d_model": int, "d_hidden": int,
     "layers": {"<i>": {"w1", "b1", "w2", "b2", "gain": bytes}, ...}}

tensors as little-endian float32 row-major bytes, layer keys decimal strings
in ascending numeric order, so equal weights encode to equal bytes.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import msgpack
import xxhash

from topology.model import WEIGHTS_FORMAT, layer_weight_bytes
from worker.plugins.base import import_torch

torch = import_torch()

TENSOR_NAMES = ("w1", "b1", "w2", "b2", "gain")
EPS = 1e-6
SEED_MAX = 2**63 - 1
_UNIFORM_BITS = 24  # randint draws in [0, 2**24): exact in float32 and float64

if sys.byteorder != "little":
    # The weights file is little-endian and frombuffer/copy_ use native order.
    raise ImportError("the layers model needs a little-endian machine")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape of the whole model and the seed of its version-1 weights."""

    layers: int
    d_model: int
    d_hidden: int
    seed: int

    def __post_init__(self) -> None:
        for name in ("layers", "d_model", "d_hidden"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= SEED_MAX:
            raise ValueError(f"ModelConfig.seed must be an int in 0..2**63-1, got {self.seed!r}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        """From a topology model dict; keys other than the four it needs are ignored."""
        if not isinstance(d, Mapping):
            raise ValueError(f"model must be a mapping, got {type(d).__name__}")
        missing = [k for k in ("layers", "d_model", "d_hidden", "seed") if k not in d]
        if missing:
            raise ValueError(f"model is missing {', '.join(repr(k) for k in missing)}")
        return cls(layers=d["layers"], d_model=d["d_model"], d_hidden=d["d_hidden"], seed=d["seed"])

    def shapes(self) -> dict[str, tuple[int, ...]]:
        d, h = self.d_model, self.d_hidden
        return {"w1": (h, d), "b1": (h,), "w2": (d, h), "b2": (d,), "gain": (d,)}

    def layer_bytes(self) -> int:
        """Bytes of one layer's float32 tensors."""
        return layer_weight_bytes(self.d_model, self.d_hidden)


@dataclass(frozen=True, slots=True, eq=False)  # tensors have no bool ==
class LayerWeights:
    """One layer's float32 tensors, plus the float64 copies the forward pass uses.

    Never mutated after construction: inference threads read it while the
    plugin swaps in a new version.
    """

    w1: torch.Tensor
    b1: torch.Tensor
    w2: torch.Tensor
    b2: torch.Tensor
    gain: torch.Tensor
    # Converted once here, not on every forward pass; w1/w2 transposed so the
    # matmul reads them as the right-hand side directly.
    _w1t: torch.Tensor = field(init=False, repr=False, compare=False)
    _b1: torch.Tensor = field(init=False, repr=False, compare=False)
    _w2t: torch.Tensor = field(init=False, repr=False, compare=False)
    _b2: torch.Tensor = field(init=False, repr=False, compare=False)
    _gain: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in TENSOR_NAMES:
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
                raise ValueError(f"LayerWeights.{name} must be a float32 tensor")
        object.__setattr__(self, "_w1t", self.w1.double().T.contiguous())
        object.__setattr__(self, "_b1", self.b1.double())
        object.__setattr__(self, "_w2t", self.w2.double().T.contiguous())
        object.__setattr__(self, "_b2", self.b2.double())
        object.__setattr__(self, "_gain", self.gain.double())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """float32 [rows, d_model] -> float32 [rows, d_model] (see the module docstring)."""
        x64 = x.double()
        n = x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + EPS) * self._gain
        h = torch.relu(torch.matmul(n, self._w1t) + self._b1)
        return (x64 + (torch.matmul(h, self._w2t) + self._b2)).float()

    def equal(self, other: "LayerWeights") -> bool:
        return all(torch.equal(getattr(self, n), getattr(other, n)) for n in TENSOR_NAMES)


def layer_seed(seed: int, i: int) -> int:
    """The 63-bit torch.Generator seed of layer `i` of the model seeded `seed`."""
    return xxhash.xxh3_64_intdigest(f"{seed}:{i}".encode()) & SEED_MAX


def _uniform(gen: torch.Generator, shape: tuple[int, ...], scale: float) -> torch.Tensor:
    """float32 values uniform on (-scale*sqrt(3), scale*sqrt(3)): variance scale**2."""
    k = torch.randint(0, 1 << _UNIFORM_BITS, shape, generator=gen, dtype=torch.int64)
    # (k + 0.5) / 2**23 - 1 is exact in float64; one multiply, one rounding to float32.
    u = (k.double() + 0.5) / float(1 << (_UNIFORM_BITS - 1)) - 1.0
    return (u * (math.sqrt(3.0) * scale)).float()


def generate_layer(cfg: ModelConfig, seed: int, i: int) -> LayerWeights:
    """Layer `i` of the model seeded `seed`: a function of (seed, i) and the shapes only."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(layer_seed(seed, i))
    d, h = cfg.d_model, cfg.d_hidden
    # Fan-in scaling keeps each block's output O(1); the residual stream then
    # grows slowly over the layers and the RMS norm keeps each block's input at 1.
    w1 = _uniform(gen, (h, d), d ** -0.5)
    b1 = _uniform(gen, (h,), 0.02)
    w2 = _uniform(gen, (d, h), 0.5 * h ** -0.5)
    b2 = _uniform(gen, (d,), 0.02)
    gain = (_uniform(gen, (d,), 0.05).double() + 1.0).float()
    return LayerWeights(w1, b1, w2, b2, gain)


def generate_layers(cfg: ModelConfig, seed: int, first: int, last: int) -> dict[int, LayerWeights]:
    """Layers first..last (inclusive) of the model seeded `seed`."""
    _check_range(cfg, first, last)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise ValueError(f"seed must be an int in 0..2**63-1, got {seed!r}")
    return {i: generate_layer(cfg, seed, i) for i in range(first, last + 1)}


def _check_range(cfg: ModelConfig, first: int, last: int) -> None:
    if not (isinstance(first, int) and isinstance(last, int) and 0 <= first <= last < cfg.layers):
        raise ValueError(f"layer range {first!r}..{last!r} is not within 0..{cfg.layers - 1}")


@dataclass(frozen=True, slots=True, eq=False)
class Weights:
    """Version `version` of layers first..last (inclusive). Immutable: replaced, never changed."""

    version: int
    first: int
    last: int
    d_model: int
    d_hidden: int
    layers: Mapping[int, LayerWeights]

    def __post_init__(self) -> None:
        if sorted(self.layers) != list(range(self.first, self.last + 1)):
            raise ValueError(f"Weights must hold exactly layers {self.first}..{self.last}")
        object.__setattr__(self, "layers", MappingProxyType(dict(sorted(self.layers.items()))))

    @classmethod
    def build(cls, cfg: ModelConfig, version: int, first: int, last: int,
              layers: Mapping[int, LayerWeights]) -> "Weights":
        return cls(version, first, last, cfg.d_model, cfg.d_hidden, layers)

    def forward(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Run layers start..end (inclusive, within first..last) on float32 `x` [rows, d_model]."""
        if not (isinstance(start, int) and isinstance(end, int) and self.first <= start <= end <= self.last):
            raise ValueError(f"layers {start!r}..{end!r} are not within the held {self.first}..{self.last}")
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 2 \
                or x.shape[1] != self.d_model:
            raise ValueError(f"x must be a float32 tensor [rows, {self.d_model}]")
        for i in range(start, end + 1):
            x = self.layers[i].forward(x)
        return x

    def nbytes(self) -> int:
        return len(self.layers) * layer_weight_bytes(self.d_model, self.d_hidden)


def run_model(cfg: ModelConfig, x: torch.Tensor, seed: int | None = None) -> torch.Tensor:
    """The one-process reference: all layers of the model seeded `seed` (default cfg.seed)."""
    layers = generate_layers(cfg, cfg.seed if seed is None else seed, 0, cfg.layers - 1)
    return Weights.build(cfg, 1, 0, cfg.layers - 1, layers).forward(x, 0, cfg.layers - 1)


# ---------------------------------------------------------------- bytes


def tensor_to_bytes(t: torch.Tensor) -> bytes:
    """Little-endian float32 row-major bytes of `t` (any shape)."""
    flat = t.detach().to(torch.float32).reshape(-1)
    out = bytearray(4 * flat.numel())
    if out:  # frombuffer refuses an empty buffer
        # No numpy here: copy into a torch view of the bytearray.
        torch.frombuffer(out, dtype=torch.float32).copy_(flat)
    return bytes(out)


def tensor_from_bytes(raw: bytes, rows: int, d_model: int) -> torch.Tensor:
    """A fresh float32 tensor [rows, d_model] from little-endian row-major bytes."""
    if len(raw) != 4 * rows * d_model:
        raise ValueError(f"expected {4 * rows * d_model} bytes for {rows}x{d_model} float32, got {len(raw)}")
    return _from_bytes(raw, (rows, d_model))


def _from_bytes(raw: bytes, shape: tuple[int, ...]) -> torch.Tensor:
    if not raw:
        return torch.zeros(shape, dtype=torch.float32)
    # bytearray: a writable copy, so the tensor owns its memory and frombuffer does not warn.
    return torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(shape)


def rows_to_tensor(rows: list[list[float]], d_model: int) -> torch.Tensor:
    """Rows of numbers -> float32 [len(rows), d_model]; ValueError for a wrong width or non-finite value."""
    if not isinstance(rows, list) or not rows:
        raise ValueError("rows must be a non-empty list of rows")
    for r, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != d_model:
            raise ValueError(f"row {r} must be a list of {d_model} numbers")
        for v in row:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"row {r} holds a non-number {type(v).__name__}")
    t = torch.tensor(rows, dtype=torch.float32)
    if not bool(torch.isfinite(t).all()):
        # Also catches finite doubles beyond float32's range (they round to inf).
        raise ValueError("rows hold a non-finite value (or one beyond float32's range)")
    return t


# ---------------------------------------------------------------- weights file


def encode_layers(cfg: ModelConfig, layers: Mapping[int, LayerWeights]) -> bytes:
    """The weights file of `layers` (deterministic bytes: keys in ascending numeric order)."""
    body = {str(i): {name: tensor_to_bytes(getattr(layers[i], name)) for name in TENSOR_NAMES}
            for i in sorted(layers)}
    doc = {"format": WEIGHTS_FORMAT, "d_model": cfg.d_model, "d_hidden": cfg.d_hidden, "layers": body}
    return msgpack.packb(doc, use_bin_type=True)


def decode_layers(raw: bytes, cfg: ModelConfig, first: int, last: int) -> dict[int, LayerWeights]:
    """Layers first..last from a weights file; ValueError saying what is wrong otherwise."""
    _check_range(cfg, first, last)
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise ValueError(f"weights file must be bytes, got {type(raw).__name__}")
    try:
        doc = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise ValueError(f"weights file is not msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"weights file must be a msgpack map, got {type(doc).__name__}")
    if doc.get("format") != WEIGHTS_FORMAT:
        raise ValueError(f"weights file format is {doc.get('format')!r}, expected {WEIGHTS_FORMAT!r}")
    extra = sorted(str(k) for k in doc if k not in ("format", "d_model", "d_hidden", "layers"))
    if extra:
        raise ValueError(f"weights file has unexpected key(s) {', '.join(extra)}")
    for name in ("d_model", "d_hidden"):
        if doc.get(name) != getattr(cfg, name) or isinstance(doc.get(name), bool):
            raise ValueError(f"weights file has {name} {doc.get(name)!r}, the model has {getattr(cfg, name)}")
    body = doc.get("layers")
    if not isinstance(body, dict):
        raise ValueError("weights file has no 'layers' map")
    wanted = [str(i) for i in range(first, last + 1)]
    missing = [k for k in wanted if k not in body]
    extra = sorted(str(k) for k in body if k not in set(wanted))
    if missing or extra:
        raise ValueError(f"weights file must hold exactly layers {first}..{last}: "
                         f"missing {missing or 'none'}, extra {extra or 'none'}")
    shapes = cfg.shapes()
    out: dict[int, LayerWeights] = {}
    for i in range(first, last + 1):
        entry = body[str(i)]
        if not isinstance(entry, dict) or set(entry) != set(TENSOR_NAMES):
            raise ValueError(f"weights file layer {i} must be a map of exactly {', '.join(TENSOR_NAMES)}")
        tensors = {}
        for name in TENSOR_NAMES:
            blob, shape = entry[name], shapes[name]
            size = 4 * math.prod(shape)
            if not isinstance(blob, bytes) or len(blob) != size:
                got = f"{len(blob)} bytes" if isinstance(blob, bytes) else type(blob).__name__
                raise ValueError(f"weights file layer {i} {name}: expected {size} bytes "
                                 f"(float32 {list(shape)}), got {got}")
            t = _from_bytes(blob, shape)
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"weights file layer {i} {name} holds a non-finite value")
            tensors[name] = t
        out[i] = LayerWeights(**tensors)
    return out
