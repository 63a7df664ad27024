"""`--target etcd-grpc`: etcd's native gRPC API, the way etcd's own clients talk to it.

The JSON gateway (`--target etcd`) converts every request to gRPC inside
etcd, which costs etcd CPU a native client does not. This sender calls
`etcdserverpb.KV` directly with grpcio, encoding the few protobuf messages
it needs by hand (Put/Range/DeleteRange/Txn requests are a handful of
length-delimited fields), so no generated stubs or protobuf runtime are
needed. grpcio is imported only when this target is used.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from shardgrid.bench.config import MISS1, Outcome, fail

if TYPE_CHECKING:
    from shardgrid.bench.load import _Target

_SERVICE = "/etcdserverpb.KV/"


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field(num: int, data: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2)."""
    return varint(num << 3 | 2) + varint(len(data)) + data


def _read_varint(msg: bytes, i: int) -> tuple[int, int]:
    """The varint at `msg[i:]` and the index after it."""
    value = shift = 0
    while True:
        b = msg[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def top_fields(msg: bytes) -> set[int]:
    """The field numbers present at the top level of a protobuf message."""
    seen: set[int] = set()
    i, n = 0, len(msg)
    while i < n:
        key, i = _read_varint(msg, i)
        num, wire = key >> 3, key & 7
        seen.add(num)
        if wire == 0:
            _, i = _read_varint(msg, i)
        elif wire == 2:
            length, i = _read_varint(msg, i)
            i += length
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
    return seen


def put_request(key: bytes, value: bytes) -> bytes:
    return field(1, key) + field(2, value)


def key_request(key: bytes) -> bytes:
    return field(1, key)


def txn_request(ops: list[tuple[int, bytes]]) -> bytes:
    """TxnRequest{success: [RequestOp{<op field>: request}]} with no compare (always succeeds)."""
    return b"".join(field(2, field(num, req)) for num, req in ops)


class GrpcEtcdSender:
    """send(kind index) -> Outcome over one gRPC channel per etcd member; never raises."""

    def __init__(self, target: "_Target") -> None:
        import grpc  # noqa: F401 - fail early, in the child, if grpcio is missing
        from grpc import aio

        self.target = target
        cfg = target.cfg
        self.timeout = cfg.timeout_s
        self.value = target.doc
        self.channels = [aio.insecure_channel(b.split("://", 1)[-1]) for b in target.bases]
        self._rr = 0
        self.calls: dict[str, list[Any]] = {
            m: [ch.unary_unary(_SERVICE + m) for ch in self.channels] for m in ("Put", "Range", "DeleteRange", "Txn")
        }
        self.plan = [self._plan(k) for k in cfg.kinds]

    def _plan(self, kind: str) -> tuple[str, Any, int]:
        n = self.target.cfg.batch
        t = self.target
        if n and kind in ("put", "delete"):
            num = 2 if kind == "put" else 3
            if kind == "put":
                return "Txn", lambda: txn_request([(num, put_request(k.encode(), self.value)) for k in t.keys(n)]), n
            return "Txn", lambda: txn_request([(num, key_request(k.encode())) for k in t.keys(n)]), n
        if kind == "put":
            return "Put", lambda: put_request(t.key().encode(), self.value), 1
        if kind == "get":
            return "Range", lambda: key_request(t.key().encode()), 1
        if kind == "delete":
            return "DeleteRange", lambda: key_request(t.key().encode()), 1
        raise ValueError(f"--target etcd-grpc does not support {kind!r}")

    async def __call__(self, kind: int) -> Outcome:
        from grpc import aio

        method, make, n = self.plan[kind]
        i = self._rr
        self._rr = i + 1 if i + 1 < len(self.channels) else 0
        try:
            raw = await self.calls[method][i](make(), timeout=self.timeout)
        except aio.AioRpcError as exc:
            code = exc.code().name.lower()
            return fail("timeout" if code == "deadline_exceeded" else f"etcd_{code}")
        except (asyncio.TimeoutError, TimeoutError):
            return fail("timeout")
        # RangeResponse.kvs is field 2, DeleteRangeResponse.deleted field 2: absent = a miss.
        if method in ("Range", "DeleteRange") and 2 not in top_fields(raw):
            return MISS1
        return (True, None, n, None, False)

    async def close(self) -> None:
        for ch in self.channels:
            await ch.close()
