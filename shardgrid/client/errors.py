"""Errors as typed exceptions, one class per error code of the gateway.

The gateway answers every error with `{"error": {"code", "message", <context>}}`
(shardgrid/common/wire.py, runbook/operations.md "Errors a client sees"). A
caller branches on the class (or `code`), never on the message.

The class says what the last answer was; `applied` says what is known of the
whole call, every attempt together. They never disagree, but they answer
different questions: an `Unavailable` (the last attempt applied nothing) has
`applied=None` when an earlier attempt of the same call timed out, for
example. Families:

- `ClientError` (4xx from the gateway): the request was not applied, and
  resending it unchanged cannot help (`RequestTimeout` excepted: the client
  already resent it).
- `Unavailable` (503 from the gateway): the last attempt applied nothing.
- `DeadlineExceeded` (504, or the deadline ran out in the client) and
  `InternalError` (500): a write's outcome may be unknown.
- `GatewayUnreachable` (no HTTP answer at all) and `ProxyError` (an answer
  without the gateway's error body: something in front of it answered): no
  promise about the write; only `applied` tells.
"""
from __future__ import annotations

from typing import Any


class ShardgridError(Exception):
    """An error answer of the gateway, or the client's own verdict when none answered.

    `status` is None when no gateway gave an HTTP answer. `applied` is False
    when the write is known not to have been applied, None when it may have
    been (retry it with `request_id`, within the dedup window, to find out
    without applying it twice), and None for reads too (nothing to apply).

    An error of one `/batch` entry has `request_id` None and the batch's id in
    `batch_request_id`: the workers keep the entry under `<id>#<i>` (or
    `#s<shard>`), so the only safe retry is the whole batch, unchanged, with
    that id; a single write resent with it would be applied a second time.
    """

    code = "internal"

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None,
                 context: dict[str, Any] | None = None, request_id: str | None = None,
                 applied: bool | None = None, attempts: int = 0, batch_request_id: str | None = None,
                 batch_index: int | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.status = status
        self.message = message
        self.context: dict[str, Any] = dict(context or {})
        self.request_id = request_id
        self.applied = applied
        self.attempts = attempts
        self.batch_request_id = batch_request_id
        self.batch_index = batch_index

    def __str__(self) -> str:
        where = f" ({self.status})" if self.status is not None else ""
        rid = f" [request id {self.request_id}]" if self.request_id else ""
        if self.batch_request_id:
            rid = (f" [batch entry {self.batch_index} of batch request id {self.batch_request_id}: resend the "
                   "whole batch, unchanged, with that request id; never this entry alone]")
        return f"{self.code}{where}: {self.message}{rid}"


class ClientError(ShardgridError):
    """4xx from the gateway: the request was not applied, and it is wrong or its answer final:
    resending it unchanged cannot help. `RequestTimeout` (408: the body did not arrive in
    time, the handler never ran) is the exception; the client has already resent it."""


class BadRequest(ClientError):
    code = "bad_request"


class Unauthorized(ClientError):
    code = "unauthorized"


class Forbidden(ClientError):
    code = "forbidden"


class NotFound(ClientError):
    code = "not_found"


class MethodNotAllowed(ClientError):
    code = "method_not_allowed"


class RequestTimeout(ClientError):
    code = "request_timeout"


class Conflict(ClientError):
    code = "conflict"


class PayloadTooLarge(ClientError):
    code = "payload_too_large"


class Unavailable(ShardgridError):
    """503 from the gateway: the last attempt applied nothing (no leader took it in time, no
    quorum, a full queue). `applied` is None only when an earlier attempt of the call may have."""

    code = "unavailable"


class NotLeader(Unavailable):
    code = "not_leader"


class Overloaded(Unavailable):
    """The group's queue is full (503), or a proxy in front of the gateway said 429: nothing was taken."""

    code = "overloaded"


class OverBudget(Unavailable):
    """A model route cannot finish within the deadline: refused at once, not retried
    (the budget only shrinks), so retry with a larger deadline."""

    code = "over_budget"


class GatewayUnreachable(ShardgridError):
    """No gateway gave an HTTP answer (connections refused, reset or timed out).

    Not an `Unavailable`: that promises nothing was applied, while a request
    that reached a gateway before its connection broke may have been.
    `applied` tells: False when every connection was refused (nothing was
    sent), None when some attempt was sent (resend with `request_id`).
    """

    code = "gateway_unreachable"


class ProxyError(ShardgridError):
    """An answer without the gateway's error body: something in front of the gateway (a proxy,
    a load balancer) answered `status` (a bare 404, 502, 503, ...). It is not the gateway's
    verdict, so the class promises nothing; `applied` tells (None for a write a proxy may have
    forwarded). A bare 408, 429, 500, 501 or 504 keeps its own class (`RequestTimeout`,
    `Overloaded`, `InternalError`, `NotImplementedByServer`, `DeadlineExceeded`)."""

    code = "proxy_error"


class DeadlineExceeded(ShardgridError):
    """504, or the caller's deadline ran out in the client."""

    code = "deadline_exceeded"


class QuorumTimeout(DeadlineExceeded):
    """A write that may or may not have committed: retry with the same request id."""

    code = "quorum_timeout"


class InternalError(ShardgridError):
    code = "internal"


class NotImplementedByServer(ShardgridError):
    code = "not_implemented"


CLASS_FOR_CODE: dict[str, type[ShardgridError]] = {
    cls.code: cls for cls in (BadRequest, Unauthorized, Forbidden, NotFound, MethodNotAllowed, RequestTimeout,
                              Conflict, PayloadTooLarge, Unavailable, NotLeader, Overloaded, OverBudget,
                              DeadlineExceeded, QuorumTimeout, InternalError, NotImplementedByServer, ProxyError)
}

# The status of each code, as the gateway's table (shardgrid/common/wire.py
# STATUS_FOR_CODE) has it: a /batch entry's error carries only its code.
STATUS_FOR_CODE: dict[str, int] = {"bad_request": 400, "unauthorized": 401, "forbidden": 403, "not_found": 404,
                                   "request_timeout": 408, "method_not_allowed": 405, "conflict": 409,
                                   "payload_too_large": 413, "not_leader": 503, "unavailable": 503,
                                   "overloaded": 503, "over_budget": 503, "quorum_timeout": 504,
                                   "deadline_exceeded": 504, "not_implemented": 501, "internal": 500}

# The code of a status that came without an error body (a proxy in front of
# the gateway, or a server too broken to answer in shape). Only statuses
# whose meaning does not depend on who answered: a bare 404 is a proxy's
# "no such route", not "no such item", so every other status is `proxy_error`.
CODE_FOR_STATUS: dict[int, str] = {408: "request_timeout", 429: "overloaded", 500: "internal",
                                   501: "not_implemented", 504: "deadline_exceeded"}


def error_code(status: int, body: Any) -> str:
    """The error code of an answer: its body's, else the status's (`proxy_error` if it has none)."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and isinstance(err.get("code"), str):
        return str(err["code"])
    return CODE_FOR_STATUS.get(status, "proxy_error")


def error_from(status: int | None, body: Any, *, request_id: str | None = None, applied: bool | None = None,
               attempts: int = 0, batch_request_id: str | None = None,
               batch_index: int | None = None) -> ShardgridError:
    """The exception for an error answer (`status` None: the client's own verdict, `body` its error body)."""
    err = body.get("error") if isinstance(body, dict) else None
    code = error_code(status or 0, body) if status is not None else str((err or {}).get("code", "unavailable"))
    if isinstance(err, dict):
        message = str(err.get("message", code))
        context = {k: v for k, v in err.items() if k not in ("code", "message")}
    else:
        message = (f"HTTP {status} without the gateway's error body (something in front of it answered): "
                   f"{str(body)[:200]}")
        context = {}
    cls = CLASS_FOR_CODE.get(code)
    if cls is None:
        cls = ClientError if status is not None and 400 <= status < 500 else ShardgridError
    return cls(message, code=code, status=status, context=context, request_id=request_id, applied=applied,
               attempts=attempts, batch_request_id=batch_request_id, batch_index=batch_index)
