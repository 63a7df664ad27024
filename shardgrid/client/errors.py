"""Errors as typed exceptions, one class per error code of the gateway.

The gateway answers every error with `{"error": {"code", "message", <context>}}`
(shardgrid/common/wire.py, runbook/operations.md "Errors a client sees"). A
caller branches on the class (or `code`), never on the message. Families
follow the retry rules: `ClientError` (4xx) means the request itself is
wrong or final and was not applied; `Unavailable` (503) means nothing was
applied; `DeadlineExceeded` (504) and `InternalError` (500) may leave a write's
outcome unknown, which `applied` says (None: unknown).
"""
from __future__ import annotations

from typing import Any


class ShardgridError(Exception):
    """An error answer of the gateway, or the client's own verdict when none answered.

    `status` is None when no gateway gave an HTTP answer. `applied` is False
    when the write is known not to have been applied, None when it may have
    been (retry it with `request_id`, within the dedup window, to find out
    without applying it twice), and None for reads too (nothing to apply).
    """

    code = "internal"

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None,
                 context: dict[str, Any] | None = None, request_id: str | None = None,
                 applied: bool | None = None, attempts: int = 0) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.status = status
        self.message = message
        self.context: dict[str, Any] = dict(context or {})
        self.request_id = request_id
        self.applied = applied
        self.attempts = attempts

    def __str__(self) -> str:
        where = f" ({self.status})" if self.status is not None else ""
        rid = f" [request id {self.request_id}]" if self.request_id else ""
        return f"{self.code}{where}: {self.message}{rid}"


class ClientError(ShardgridError):
    """4xx: the request is wrong or its answer final; retrying it unchanged cannot help."""


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
    """503: nothing was applied (no leader took it in time, or no quorum)."""

    code = "unavailable"


class NotLeader(Unavailable):
    code = "not_leader"


class Overloaded(Unavailable):
    code = "overloaded"


class OverBudget(Unavailable):
    """A model route cannot finish within the deadline: refused at once, not retried
    (the budget only shrinks), so retry with a larger deadline."""

    code = "over_budget"


class GatewayUnreachable(Unavailable):
    """No gateway gave an HTTP answer (connections refused, reset or timed out)."""


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
                              DeadlineExceeded, QuorumTimeout, InternalError, NotImplementedByServer)
}

# The status of each code, as the gateway's table (shardgrid/common/wire.py
# STATUS_FOR_CODE) has it: a /batch entry's error carries only its code.
STATUS_FOR_CODE: dict[str, int] = {"bad_request": 400, "unauthorized": 401, "forbidden": 403, "not_found": 404,
                                   "request_timeout": 408, "method_not_allowed": 405, "conflict": 409,
                                   "payload_too_large": 413, "not_leader": 503, "unavailable": 503,
                                   "overloaded": 503, "over_budget": 503, "quorum_timeout": 504,
                                   "deadline_exceeded": 504, "not_implemented": 501, "internal": 500}

# The code of a status that came without an error body (a proxy in front of
# the gateway, or a server too broken to answer in shape), as the gateway's
# own table (shardgrid/common/wire.py CODE_FOR_STATUS) maps it.
CODE_FOR_STATUS: dict[int, str] = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
                                   405: "method_not_allowed", 409: "conflict", 413: "payload_too_large",
                                   501: "not_implemented", 502: "unavailable", 503: "unavailable",
                                   504: "deadline_exceeded"}


def error_code(status: int, body: Any) -> str:
    """The error code of an answer: its body's, else the status's most general one."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and isinstance(err.get("code"), str):
        return str(err["code"])
    return CODE_FOR_STATUS.get(status, "bad_request" if 400 <= status < 500 else "internal")


def error_from(status: int | None, body: Any, *, request_id: str | None = None, applied: bool | None = None,
               attempts: int = 0) -> ShardgridError:
    """The exception for an error answer (`status` None: the client's own verdict, `body` its error body)."""
    err = body.get("error") if isinstance(body, dict) else None
    code = error_code(status or 0, body) if status is not None else str((err or {}).get("code", "unavailable"))
    if isinstance(err, dict):
        message = str(err.get("message", code))
        context = {k: v for k, v in err.items() if k not in ("code", "message")}
    else:
        message = f"HTTP {status} without an error body: {str(body)[:200]}"
        context = {}
    cls = CLASS_FOR_CODE.get(code)
    if cls is None:
        cls = ClientError if status is not None and 400 <= status < 500 else ShardgridError
    return cls(message, code=code, status=status, context=context, request_id=request_id, applied=applied,
               attempts=attempts)
