"""The retry and routing rules of the client, without I/O (sans-I/O).

Both clients (`sync.py` over http.client, `aio.py` over aiohttp) drive the
same `CallPlan`: it says which gateway to send an attempt to, when, with
which headers and socket timeout, and, given what came back (`Outcome`),
whether to stop or try again. Nothing here reads a clock, sleeps or opens a
socket: the caller passes `now` in, so the rules are tested exactly, with
no timing in the tests.

The rules (runbook/client.md explains why each holds):

- Every attempt of one call carries the same `x-request-id` (writes get one
  generated once per logical write): a write resent with it is answered from
  the group's dedup table, never applied twice.
- Reads are always safe to resend. A write is resent only with its request
  id, and only if the resend is sent within `write_retry_window_s` of its
  first attempt (the dedup window; a batch's window spans all its resend
  rounds, `WriteWindow`). A call without an id is resent only when nothing
  reached a gateway (the connection was refused) or when the answer said
  nothing was applied (503 `not_leader`, `unavailable`, `overloaded`, 408
  `request_timeout`, a proxy's 429).
- Other 4xx, 501 and 503 `over_budget` are final: resending them unchanged
  cannot help. A 500 (with the gateway's error body or without) is resent
  once. 504 is resent (a write with its id).
- The caller's deadline bounds everything: each attempt carries what is
  left of it in `x-deadline-ms` (computed again by the client just before
  the request is written, `budget()`), and no attempt starts with less than
  `min_attempt_s` left.
- An attempt that failed moves the call to a gateway it has not tried yet,
  at once; going back to one already tried waits (exponential backoff with
  jitter). `unavailable` and `overloaded` (and a proxy's 429) wait at least
  their `retry-after` whichever gateway is next: the group leader they speak
  of is behind every gateway. A wait that would leave less than
  `min_attempt_s` of the deadline ends the call at once instead.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Literal, Mapping

from shardgrid.client.errors import DeadlineExceeded, GatewayUnreachable, ShardgridError
from topology.routing import shard_for

MAX_DEADLINE_MS = 300_000  # the gateway refuses a larger x-deadline-ms with 400

Kind = Literal["read", "write"]
Failure = Literal["refused", "broken", "timeout"]

# Error codes after which the gateway promises nothing was applied: safe to
# resend even a call without a request id, on another gateway. (408: the body
# did not arrive whole, the handler never ran.)
NOT_APPLIED_RETRYABLE = frozenset({"not_leader", "unavailable", "overloaded", "request_timeout"})
# Statuses that mean "not taken" whoever answered them, even without the
# gateway's error body: a proxy's 408 (the body did not reach it) and 429
# (its rate limit refused the request before forwarding it).
NOT_APPLIED_BARE_STATUSES = frozenset({408, 429})
# Codes whose write may or may not have been applied: resent only with the request id.
UNKNOWN_RETRYABLE = frozenset({"quorum_timeout", "deadline_exceeded"})
# Codes that speak of the shard group (its leader, its queue), which every
# gateway forwards to: wait `retry-after` before the next attempt, on any gateway.
HONOUR_RETRY_AFTER = frozenset({"unavailable", "overloaded"})


@dataclass(frozen=True)
class RetryPolicy:
    """The knobs of the retry rules; the defaults suit the gateway's defaults."""

    max_attempts: int = 10
    backoff_base_s: float = 0.05
    backoff_cap_s: float = 1.0
    # Below this much budget an attempt cannot get an answer back in time.
    min_attempt_s: float = 0.02
    # The dedup window's guarantee is 10 minutes, but under load the 100,000
    # ids per group end first (about 3 s at 30,000 writes/s to one group):
    # lower this when writing that fast (runbook/operations.md).
    write_retry_window_s: float = 600.0
    # A gateway that refused a connection or dropped one is tried last for this long.
    gateway_down_s: float = 2.0
    # The gateway answers by the deadline it was given; this covers the way back.
    # So a call returns within its deadline_s plus this (0: the deadline is a hard
    # bound, and an answer the gateway sends right at the deadline is abandoned).
    response_margin_s: float = 0.5
    # How many internal (500) answers one call (or one batch entry) is resent after.
    internal_retries: int = 1


@dataclass(frozen=True)
class Call:
    """One logical request, the same on every attempt."""

    method: str
    path: str
    body: bytes | None
    kind: Kind
    request_id: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def resendable(self) -> bool:
        """Whether an attempt with an unknown outcome may be sent again."""
        return self.kind == "read" or self.request_id is not None


@dataclass(frozen=True)
class Outcome:
    """What one attempt got: an HTTP answer (`status`, its error `code`), or a `failure`.

    `failure`: refused (no connection, nothing sent), broken (sent, the
    connection failed before an answer), timeout (sent, no answer in time).
    `shaped`: the error answer had the gateway's error body (a proxy's bare
    502/503/504 did not, and says nothing about what was applied).
    """

    status: int | None = None
    code: str | None = None
    failure: Failure | None = None
    retry_after_s: float | None = None
    shaped: bool = True
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


@dataclass
class WriteWindow:
    """When a write was first sent: its dedup window (`write_retry_window_s`) starts there.

    One per logical write: a batch's resend rounds are separate `CallPlan`s
    sharing one, so a later round cannot restart the window.
    """

    first_sent: float | None = None

    def admits(self, at: float, policy: RetryPolicy) -> bool:
        """Whether a resend sent at `at` is still within the window."""
        return self.first_sent is None or at - self.first_sent <= policy.write_retry_window_s


def deadline_ms(remaining_s: float) -> str:
    """The x-deadline-ms header for `remaining_s` of budget (1 ms at least, the gateway's cap at most)."""
    return str(max(1, min(MAX_DEADLINE_MS, int(remaining_s * 1000))))


@dataclass(frozen=True)
class Send:
    """Send attempt `attempt` (1-based) to gateway index `gateway` at monotonic time `at`."""

    gateway: int
    at: float
    headers: dict[str, str]
    timeout_s: float
    attempt: int


@dataclass(frozen=True)
class Stop:
    """No more attempts. `error` None: the last answer is the result (success or
    an error answer to raise); else raise `error` (no usable answer came)."""

    error: ShardgridError | None
    applied: bool | None  # for an error: False known not applied, None perhaps (writes)


class GatewayPool:
    """Which gateway to use: the one that last answered, and those that failed last.

    Shared by every call of one client (not global: two clients keep their own).
    """

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError("at least one gateway is needed")
        self.count = count
        self.preferred = 0
        self.down_until = [0.0] * count

    def pick(self, now: float, tried: set[int]) -> int:
        order = [(self.preferred + i) % self.count for i in range(self.count)]
        for g in order:
            if g not in tried and self.down_until[g] <= now:
                return g
        for g in order:  # every untried one is down: one of them still beats a tried one
            if g not in tried:
                return g
        return min(order, key=lambda g: self.down_until[g])

    def failed(self, g: int, now: float, down_s: float) -> None:
        self.down_until[g] = now + down_s
        if self.preferred == g:
            self.preferred = (g + 1) % self.count

    def answered(self, g: int) -> None:
        self.down_until[g] = 0.0
        self.preferred = g


class CallPlan:
    """The attempts of one call: `start(now)`, then `next(outcome, now)` after each."""

    def __init__(self, call: Call, pool: GatewayPool, policy: RetryPolicy, deadline: float,
                 rng: random.Random, window: WriteWindow | None = None) -> None:
        self.call = call
        self.pool = pool
        self.policy = policy
        self.deadline = deadline  # monotonic time
        self.rng = rng
        self.attempts = 0
        self.tried: set[int] = set()
        self.window = window if window is not None else WriteWindow()
        self.maybe_applied = False  # a write attempt's outcome was unknown
        self.only_refused = True  # every failure so far was a refused connection
        self._internal = 0
        self._backoffs = 0
        self._current: Send | None = None

    # -- the two steps

    def start(self, now: float) -> Send | Stop:
        return self._send(self.pool.pick(now, self.tried), now, now)

    def next(self, outcome: Outcome, now: float) -> Send | Stop:
        assert self._current is not None, "next() before start()"
        g = self._current.gateway
        if outcome.ok:
            self.pool.answered(g)
            return Stop(None, True)
        unknown = self._unknown(outcome)
        if unknown and self.call.kind == "write":
            self.maybe_applied = True
        if outcome.failure != "refused":
            self.only_refused = False
        if outcome.failure is not None or (not outcome.shaped and (outcome.status or 0) >= 500):
            self.pool.failed(g, now, self.policy.gateway_down_s)
        if not self._retryable(outcome, unknown):
            return self._stop(outcome)
        if self.attempts >= self.policy.max_attempts:
            return self._stop(outcome)
        target = self.pool.pick(now, self.tried)
        delay = self._backoff() if target in self.tried else 0.0
        if outcome.retry_after_s is not None and self._group_wide(outcome, target):
            delay = max(delay, outcome.retry_after_s)
        # The window is checked at the time the resend would go out, not now: a
        # retry-after or a backoff can carry it past the end of the window.
        if self.call.kind == "write" and not self.window.admits(now + delay, self.policy):
            return self._stop(outcome)
        return self._send(target, now + delay, now, outcome)

    def budget(self, now: float) -> tuple[str, float]:
        """(x-deadline-ms, I/O timeout) for an attempt written at `now`.

        The client calls it just before writing the request, so the time spent
        connecting or oversleeping the planned send time is not promised to the
        gateway. The timeout adds `response_margin_s` for the way back.
        """
        remaining = max(0.0, self.deadline - now)
        return deadline_ms(remaining), remaining + self.policy.response_margin_s

    # -- rules

    def _group_wide(self, o: Outcome, target: int) -> bool:
        """Whether `o`'s retry-after holds for `target` too (see HONOUR_RETRY_AFTER)."""
        if o.status == 429:
            return True  # a proxy's rate limit: waiting is what it asks of every client
        if o.code in HONOUR_RETRY_AFTER:
            # The gateway's own answer speaks of the group; a bare proxy 503 only of what is behind that proxy.
            return o.shaped or target in self.tried
        return False

    def _unknown(self, o: Outcome) -> bool:
        """Whether the attempt may have been applied without saying so."""
        if o.failure is not None:
            return o.failure != "refused"
        if o.status is not None and o.status >= 500 and o.status != 501 and not o.shaped:
            return True  # a proxy's 5xx (501 excepted: "no such method" is final) says nothing of the write
        return o.code in UNKNOWN_RETRYABLE or o.code == "internal"

    def _retryable(self, o: Outcome, unknown: bool) -> bool:
        if o.failure == "refused":
            return True
        if o.code in NOT_APPLIED_RETRYABLE and (o.shaped or o.status in NOT_APPLIED_BARE_STATUSES):
            return True
        if o.status == 500 or o.code == "internal":
            # With the gateway's body or without: a 500 is a bug, resent once whoever answered it.
            self._internal += 1
            return self.call.resendable and self._internal <= self.policy.internal_retries
        if unknown:
            return self.call.resendable
        return False

    def _backoff(self) -> float:
        self._backoffs += 1
        ceiling = min(self.policy.backoff_cap_s, self.policy.backoff_base_s * 2 ** (self._backoffs - 1))
        return ceiling * (0.5 + self.rng.random() / 2)  # jitter: clients that failed together spread out

    def _send(self, gateway: int, at: float, now: float, last: Outcome | None = None) -> Send | Stop:
        remaining = self.deadline - at
        if remaining < self.policy.min_attempt_s:
            return self._stop(last, out_of_time=True)
        headers = dict(self.call.headers)
        if self.call.request_id is not None:
            headers["x-request-id"] = self.call.request_id
        headers["x-deadline-ms"] = deadline_ms(remaining)
        self.attempts += 1
        self.tried.add(gateway)
        if self.window.first_sent is None:
            self.window.first_sent = at
        self._current = Send(gateway, at, headers, remaining + self.policy.response_margin_s, self.attempts)
        return self._current

    def _applied(self) -> bool | None:
        if self.call.kind != "write":
            return None
        return None if self.maybe_applied else False

    def _stop(self, last: Outcome | None, out_of_time: bool = False) -> Stop:
        applied = self._applied()
        if last is not None and last.status is not None:
            return Stop(None, applied)  # the last answer says more than "gave up" would
        rid = self.call.request_id
        if last is None and out_of_time:
            return Stop(DeadlineExceeded("the deadline left no time for an attempt", status=None,
                                         request_id=rid, applied=False, attempts=self.attempts), False)
        detail = last.detail if last is not None else ""
        if self.only_refused:
            return Stop(GatewayUnreachable(f"no gateway accepted a connection ({self.attempts} attempts): {detail}",
                                           status=None, request_id=rid, applied=False,
                                           attempts=self.attempts), False)
        hint = " Its outcome is unknown: retry with the same request_id." if applied is None and rid else ""
        timed_out = out_of_time or (last is not None and last.failure == "timeout")
        cls = DeadlineExceeded if timed_out else GatewayUnreachable
        return Stop(cls(f"no answer after {self.attempts} attempts: {detail}.{hint}", status=None, request_id=rid,
                        applied=applied, attempts=self.attempts), applied)


class SeqTracker:
    """Read-your-writes: the highest seq seen per shard, sent as `x-min-seq`.

    Seqs are per shard and an entity always maps to the same shard (FNV-1a of
    its id modulo the shard count, topology/routing.py), so a read carries the
    highest seq this session saw on the shard its entity lives in.
    """

    def __init__(self) -> None:
        self.seqs: dict[int, int] = {}
        self.shards: int | None = None  # learned from a gateway's /healthz

    def saw(self, shard: int | None, seq: int | None) -> None:
        if shard is None or seq is None:
            return
        if seq > self.seqs.get(shard, 0):
            self.seqs[shard] = seq

    def needs_shard_count(self) -> bool:
        return bool(self.seqs) and self.shards is None

    def shard_of(self, key: str) -> int | None:
        if self.shards is None:
            return None
        return shard_for(key, self.shards)

    def min_seq(self, key: str) -> int:
        shard = self.shard_of(key)
        return self.seqs.get(shard, 0) if shard is not None else 0

    def check_shard(self, key: str, shard: int | None) -> None:
        """An answer from another shard than the hash says: the count changed; learn it again."""
        if shard is not None and self.shards is not None and self.shard_of(key) != shard:
            self.shards = None
