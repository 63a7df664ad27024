"""The Python client of shardgrid's gateways (runbook/client.md).

    from shardgrid.client import Client
    with Client(["http://127.0.0.1:8080", "http://127.0.0.1:8081"]) as c:
        c.put("hello", {"greeting": "hi"})
        c.incr("u1", "clicks")

`AsyncClient` is the same over asyncio. The retry rules live in
`shardgrid.client.policy` (no I/O), shared by both.
"""
from shardgrid.client.aio import AsyncClient
from shardgrid.client.errors import (BadRequest, ClientError, Conflict, DeadlineExceeded, Forbidden,
                                     GatewayUnreachable, InternalError, MethodNotAllowed, NotFound,
                                     NotImplementedByServer, NotLeader, OverBudget, Overloaded, PayloadTooLarge,
                                     ProxyError, QuorumTimeout, RequestTimeout, ShardgridError, Unauthorized,
                                     Unavailable)
from shardgrid.client.policy import RetryPolicy
from shardgrid.client.results import (BatchEntry, BatchResult, Deleted, Embedding, Hit, InferResult, Item,
                                      SearchResult, Served, SignalWritten, Signals, Written)
from shardgrid.client.sync import Client

__all__ = ["AsyncClient", "BadRequest", "BatchEntry", "BatchResult", "Client", "ClientError", "Conflict",
           "DeadlineExceeded", "Deleted", "Embedding", "Forbidden", "GatewayUnreachable", "Hit", "InferResult",
           "InternalError", "Item", "MethodNotAllowed", "NotFound", "NotImplementedByServer", "NotLeader",
           "OverBudget", "Overloaded", "PayloadTooLarge", "ProxyError", "QuorumTimeout", "RequestTimeout",
           "RetryPolicy", "SearchResult", "Served", "ShardgridError", "SignalWritten", "Signals", "Unauthorized",
           "Unavailable", "Written"]
