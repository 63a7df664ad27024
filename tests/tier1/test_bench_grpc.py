"""`--target etcd-grpc`: the hand-encoded protobuf and the sender, against a fake etcd KV service."""
from __future__ import annotations

import random
from typing import Any

import grpc
from grpc import aio

from shardgrid.bench.grpc_client import GrpcEtcdSender, field, put_request, top_fields, txn_request, varint
from shardgrid.bench.load import LoadConfig, make_target


def parse(msg: bytes) -> list[tuple[int, bytes]]:
    """Top-level length-delimited fields of a message, in order (enough for these requests)."""
    out, i = [], 0
    while i < len(msg):
        key, i = _varint(msg, i)
        assert key & 7 == 2, "only length-delimited fields are expected"
        n, i = _varint(msg, i)
        out.append((key >> 3, msg[i:i + n]))
        i += n
    return out


def _varint(b: bytes, i: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        v |= (b[i] & 0x7F) << shift
        shift += 7
        i += 1
        if not b[i - 1] & 0x80:
            return v, i


def test_protobuf_encoding_matches_the_wire_format() -> None:
    assert varint(1) == b"\x01" and varint(300) == b"\xac\x02"
    assert field(1, b"k") == b"\x0a\x01k"
    assert parse(put_request(b"key", b"v" * 200)) == [(1, b"key"), (2, b"v" * 200)]
    txn = parse(txn_request([(2, put_request(b"a", b"1")), (2, put_request(b"b", b"2"))]))
    assert [n for n, _ in txn] == [2, 2] and parse(txn[1][1]) == [(2, put_request(b"b", b"2"))]
    assert top_fields(b"\x0a\x00\x12\x03abc\x18\x05") == {1, 2, 3}


class _FakeKV:
    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.calls: list[tuple[str, bytes]] = []

    def handler(self) -> grpc.GenericRpcHandler:
        def unary(name: str) -> grpc.RpcMethodHandler:
            async def call(req: bytes, ctx: Any) -> bytes:
                self.calls.append((name, req))
                f = dict(parse(req))
                if name == "Put":
                    if f[1].startswith(b"refuse"):
                        await ctx.abort(grpc.StatusCode.UNAVAILABLE, "no leader")
                    self.data[f[1]] = f[2]
                    return field(1, b"")  # header only
                if name == "Range":
                    return field(1, b"") + (field(2, field(1, f[1])) if f[1] in self.data else b"")
                return field(1, b"")
            return grpc.unary_unary_rpc_method_handler(call)
        return grpc.method_handlers_generic_handler("etcdserverpb.KV", {m: unary(m) for m in ("Put", "Range")})


async def test_sender_puts_gets_and_maps_errors() -> None:
    kv = _FakeKV()
    server = aio.server()
    server.add_generic_rpc_handlers((kv.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        cfg = LoadConfig(target="etcd-grpc", urls=(f"http://127.0.0.1:{port}",), mix=(("put", 1.0), ("get", 1.0)),
                         keys=1, value_bytes=50, timeout_s=5.0)
        target = make_target(cfg, random.Random(3))
        send = GrpcEtcdSender(target)
        try:
            assert await send(1) == (True, None, 1, None, True)  # get before any put: a miss
            assert await send(0) == (True, None, 1, None, False)
            assert await send(1) == (True, None, 1, None, False)  # now found
            assert kv.data == {b"bench-0": target.doc}
            assert [c for c, _ in kv.calls] == ["Range", "Put", "Range"]
            refused = GrpcEtcdSender(make_target(LoadConfig(target="etcd-grpc", urls=cfg.urls, key_prefix="refuse",
                                                            keys=1), random.Random(1)))
            try:
                assert (await refused(0))[:2] == (False, "etcd_unavailable")
            finally:
                await refused.close()
        finally:
            await send.close()
    finally:
        await server.stop(None)
