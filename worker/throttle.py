"""How much snapshot data a worker serves: downloads at once, and bytes per second.

A learner (a new replica, a repair, a move) catches up by downloading its
leader's latest snapshot. Without limits a worker that leads many groups
would serve every such download at full speed at once, and starve its own
replication traffic (and its disk) while a drain or a repair moves many
replicas. Two limits, both from the topology's settings:

- `snapshot_concurrency` downloads served at once; one more is refused
  (the API answers `503 unavailable`, reason `snapshot_busy`) and the
  downloader retries later with backoff;
- `snapshot_rate_mb_s` MB/s of snapshot data sent, shared by all the
  downloads this worker serves (a token bucket); 0 means unlimited.

Pure: no clock and no asyncio. The caller passes the time (monotonic
seconds) and does the waiting, so the tests drive it with a fake clock.
"""
from __future__ import annotations

from dataclasses import dataclass

MB = 1_000_000  # decimal, as shardgrid/common/units.py reads and prints sizes
# The `reason` of the 503 answer to a download beyond the limit: the downloader waits for a turn.
SNAPSHOT_BUSY = "snapshot_busy"


@dataclass
class TokenBucket:
    """A token bucket in bytes, whose takers may run into debt.

    `reserve(n, now)` takes `n` tokens at once and says how long the caller
    must wait before it sends them: several senders sharing the bucket are
    thereby queued in the order they asked, and together they never exceed
    `rate` over any stretch longer than `burst / rate`. A rate of 0 is
    unlimited (nothing ever waits).
    """

    rate: float  # bytes per second; 0 = unlimited
    burst: float  # bytes that may go out at once after an idle spell
    tokens: float = 0.0
    at: float = 0.0  # when `tokens` was last brought up to date

    def __post_init__(self) -> None:
        if self.rate < 0 or self.burst <= 0:
            raise ValueError(f"a token bucket needs rate >= 0 and burst > 0, got {self.rate}, {self.burst}")

    @classmethod
    def full(cls, rate: float, burst: float, now: float) -> "TokenBucket":
        return cls(rate, burst, tokens=burst, at=now)

    def _refill(self, now: float) -> None:
        if now > self.at:
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
            self.at = now

    def reserve(self, n: int, now: float) -> float:
        """Take `n` bytes' worth; the seconds to wait before sending them (0: send now)."""
        if self.rate == 0:
            return 0.0
        self._refill(now)
        self.tokens -= n
        return -self.tokens / self.rate if self.tokens < 0 else 0.0

    def set_rate(self, rate: float, burst: float, now: float) -> None:
        """A new rate from now on; what was earned (or owed) so far is kept."""
        if rate < 0 or burst <= 0:
            raise ValueError(f"a token bucket needs rate >= 0 and burst > 0, got {rate}, {burst}")
        if self.rate == 0:
            # Unlimited until now: nothing owed, start full.
            self.tokens, self.at = burst, now
        else:
            self._refill(now)
            self.tokens = min(burst, self.tokens)
        self.rate, self.burst = rate, burst


# A chunk of snapshot data as the server sends it: small enough that a low
# rate still streams smoothly, large enough that 64 MB/s is ~250 writes a second.
CHUNK = 256 * 1024
MIN_CHUNK = 16 * 1024


def burst_for(rate: float) -> float:
    """What may go out at once: a tenth of a second's worth, at least one chunk."""
    return max(float(CHUNK), rate / 10)


@dataclass
class SnapshotServing:
    """The snapshot downloads one worker serves: a slot each, and one shared bucket.

    `try_start()` takes a slot (False: all `concurrency` are taken: answer
    busy); `finish()` gives it back, whatever way the download ended.
    """

    concurrency: int
    bucket: TokenBucket
    serving: int = 0

    @classmethod
    def create(cls, concurrency: int, rate_mb_s: int, now: float) -> "SnapshotServing":
        rate = float(rate_mb_s * MB)
        if concurrency < 1:
            raise ValueError(f"snapshot concurrency must be at least 1, got {concurrency}")
        return cls(concurrency, TokenBucket.full(rate, burst_for(rate), now))

    def configure(self, concurrency: int, rate_mb_s: int, now: float) -> None:
        """New limits (the topology's settings changed). Downloads already
        served keep their slots even when the new limit is lower: they end
        by themselves, and no new one starts until the count is below it."""
        if concurrency < 1:
            raise ValueError(f"snapshot concurrency must be at least 1, got {concurrency}")
        rate = float(rate_mb_s * MB)
        self.concurrency = concurrency
        if rate != self.bucket.rate:
            self.bucket.set_rate(rate, burst_for(rate), now)

    def try_start(self) -> bool:
        if self.serving >= self.concurrency:
            return False
        self.serving += 1
        return True

    def finish(self) -> None:
        if self.serving <= 0:
            raise RuntimeError("finish() without a matching try_start()")
        self.serving -= 1

    def chunk(self) -> int:
        """The bytes to send at a time. Downloads take turns at the bucket, so
        each waits for the others' chunks between two of its own: at a low
        rate a full chunk each would leave a downloader silent long enough to
        time out (its socket read timeout is 10 s), so a chunk is at most
        a quarter second's share."""
        if self.bucket.rate == 0:
            return CHUNK
        share = int(self.bucket.rate / (4 * max(1, self.concurrency)))
        return max(MIN_CHUNK, min(CHUNK, share))

    def reserve(self, n: int, now: float) -> float:
        """Seconds to wait before sending `n` more bytes of some download."""
        return self.bucket.reserve(n, now)
