"""A worker's answer as the gateway sees it, and the failure of an attempt that got none.

Below both gateway/calls.py (the call streams, which build replies) and
gateway/forward.py (the retry loop, which reads them), so neither imports the other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from multidict import CIMultiDictProxy

from shardgrid.common.wire import CODE_FOR_STATUS, STATUS_FOR_CODE, error_body

if TYPE_CHECKING:
    from gateway.router import Target



@dataclass(slots=True)
class WorkerReply:
    status: int
    code: str | None  # None = success
    body: Any  # success: {"seq", "term", "result"}; failure: the error body
    served_by: str | None
    shard: int | None
    term: int | None
    seq: int | None

    @property
    def ok(self) -> bool:
        return self.code is None

    @property
    def result(self) -> Any:
        return self.body.get("result") if isinstance(self.body, dict) else None

    @property
    def error(self) -> dict[str, Any]:
        err = self.body.get("error") if isinstance(self.body, dict) else None
        return err if isinstance(err, dict) else {}


class AttemptFailed(Exception):
    """An attempt got no answer. kind: refused (nothing sent) | timeout | broken."""

    def __init__(self, kind: str, sent: bool, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.sent = sent
        self.detail = detail


def int_or_none(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return None
    return None


def reply_from(status: int, headers: CIMultiDictProxy[str] | dict[str, str], body: Any, target: Target,
               gid: int | None) -> WorkerReply:
    """A worker's decoded answer (from HTTP or the call stream) as a WorkerReply."""
    served_by = headers.get("x-served-by") or target.wid
    term = int_or_none(headers.get("x-term"))
    seq = int_or_none(headers.get("x-seq"))
    if 200 <= status < 300 and isinstance(body, dict):
        return WorkerReply(status, None, body, served_by, gid, term if term is not None else int_or_none(body.get("term")),
                           seq if seq is not None else int_or_none(body.get("seq")))
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or not isinstance(err.get("code"), str):
        code = CODE_FOR_STATUS.get(status, "internal")
        body = error_body(code, f"worker {target.wid} answered {status}: {str(body)[:200]}", shard=gid)
        err = body["error"]
    if status < 400:
        status = STATUS_FOR_CODE.get(err["code"], 500)
    return WorkerReply(status, err["code"], body, served_by, gid,
                       term if term is not None else int_or_none(err.get("term")), seq)


def item_reply(item: Any, target: Target, gid: int) -> WorkerReply:
    """One entry of a write_batch answer, as if it had been a single write."""
    if isinstance(item, dict) and "error" in item:
        err = item["error"] if isinstance(item["error"], dict) else {}
        code = str(err.get("code", "internal"))
        return WorkerReply(STATUS_FOR_CODE.get(code, 500), code, item, target.wid, gid, int_or_none(err.get("term")), None)
    if isinstance(item, dict):
        return WorkerReply(200, None, item, target.wid, gid, int_or_none(item.get("term")), int_or_none(item.get("seq")))
    return WorkerReply(500, "internal", error_body("internal", f"worker {target.wid} sent a malformed batch result",
                                                   shard=gid), target.wid, gid, None, None)
