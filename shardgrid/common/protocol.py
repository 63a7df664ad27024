"""The intra-cluster streams, in one place: what gateway and worker (and
worker and worker) must agree on.

* The call stream, `CALLS_PATH` (a WebSocket a gateway opens to each
  worker): binary frames (`wire.pack_frames`) of calls `[id, op, gid, body]`
  in, of answers `[id, status, body]` out; `op` is one of `CALL_OPS`, whose
  `body` and answer are those of the worker's HTTP route of that name.
* The peer stream, `STREAM_PATH` (a WebSocket a worker opens to each peer):
  frames of replication messages (worker/codec.py), no answers.
* Both ping every `HEARTBEAT_S` to notice a peer that vanished without a
  reset, and carry frames of at most `MAX_FRAME` bytes.
"""
from __future__ import annotations

CALLS_PATH = "/v1/calls"
STREAM_PATH = "/v1/raft/stream"
CALL_OPS = ("write", "write_batch", "read", "infer")
HEARTBEAT_S = 3.0
MAX_FRAME = 64 << 20
