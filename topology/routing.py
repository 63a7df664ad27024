"""Entity -> shard routing: FNV-1a 64 over the UTF-8 bytes of the entity id.

The hash is part of the on-disk contract (it decides which group owns which
data), so it must never change. Test vectors:
"" -> 0xcbf29ce484222325, "a" -> 0xaf63dc4c8601ec8c, "foobar" -> 0x85944171f73967e8.
"""
from __future__ import annotations

FNV_OFFSET_BASIS = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
_MASK = 0xFFFFFFFFFFFFFFFF


def fnv1a64(data: bytes | str) -> int:
    if isinstance(data, str):
        data = data.encode("utf-8")
    # Locals, not globals, in the loop: this runs for every gateway request.
    h = FNV_OFFSET_BASIS
    prime = FNV_PRIME
    mask = _MASK
    for byte in data:
        h = ((h ^ byte) * prime) & mask
    return h


def shard_for(entity_id: str, shards: int) -> int:
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    return fnv1a64(entity_id) % shards
