"""Entity -> shard routing: FNV-1a 64 over the UTF-8 bytes of the entity id.

The hash is part of the on-disk contract (it decides which group owns which
data), so it must never change. Test vectors:
"" -> 0xcbf29ce484222325, "a" -> 0xaf63dc4c8601ec8c, "foobar" -> 0x85944171f73967e8.

`fnv1a64_reference` is the contract written out in Python. The gateway
hashes every write of every `/batch`, where the Python loop was a visible
share of a record's gateway CPU (runbook/benchmarking.md, "Measurements
behind constants"), so `fnv1a64` and `shard_function` call the C
implementation of `fnv-c`; a test holds the two to the same answers over
arbitrary strings.
"""
from __future__ import annotations

from typing import Callable

from fnv_c.ext._fnv import lib as _fnv_lib

FNV_OFFSET_BASIS = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
_MASK = 0xFFFFFFFFFFFFFFFF
# The library's own wrapper adds an assert and a Python call per hash; its
# cffi function takes (bytes, length) and returns the unsigned 64-bit hash.
_fnv1a_64: Callable[[bytes, int], int] = _fnv_lib.fnv1a_64


def fnv1a64_reference(data: bytes | str) -> int:
    if isinstance(data, str):
        data = data.encode("utf-8")
    h = FNV_OFFSET_BASIS
    for byte in data:
        h = ((h ^ byte) * FNV_PRIME) & _MASK
    return h


def fnv1a64(data: bytes | str) -> int:
    if isinstance(data, str):
        data = data.encode("utf-8")
    return _fnv1a_64(data, len(data))


def shard_function(shards: int) -> Callable[[str], int]:
    """`shard_for(entity_id, shards)` for many ids: one closure, no checks per call."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    h = _fnv1a_64

    def shard(entity_id: str) -> int:
        data = entity_id.encode("utf-8")
        return h(data, len(data)) % shards

    return shard


def shard_for(entity_id: str, shards: int) -> int:
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    return fnv1a64(entity_id) % shards
