"""The snapshot-serving limits (worker/throttle.py), driven by a fake clock."""
from __future__ import annotations

import pytest

from worker.throttle import CHUNK, MB, MIN_CHUNK, SnapshotServing, TokenBucket


def send_all(bucket: TokenBucket, chunks: list[int], start: float = 0.0) -> float:
    """Send `chunks` one after the other as a server loop would (wait, then send); the time it ends."""
    now = start
    for n in chunks:
        now += bucket.reserve(n, now)
    return now


def test_a_full_bucket_lets_its_burst_through_at_once_then_holds_to_the_rate() -> None:
    b = TokenBucket.full(rate=1000, burst=500, now=0.0)
    assert b.reserve(500, 0.0) == 0.0
    assert b.reserve(250, 0.0) == pytest.approx(0.25)
    # 1000 bytes after the burst at 1000 B/s: one second past the start, whatever the chunking.
    assert send_all(TokenBucket.full(1000, 500, 0.0), [100] * 15) == pytest.approx(1.0)
    assert send_all(TokenBucket.full(1000, 500, 0.0), [500, 1000]) == pytest.approx(1.0)


def test_idle_time_earns_at_most_one_burst() -> None:
    b = TokenBucket.full(rate=1000, burst=500, now=0.0)
    assert b.reserve(500, 0.0) == 0.0
    # An hour idle is worth one burst, not 3.6 MB.
    assert b.reserve(500, 3600.0) == 0.0
    assert b.reserve(1000, 3600.0) == pytest.approx(1.0)


def test_senders_sharing_a_bucket_share_its_rate_in_the_order_they_asked() -> None:
    b = TokenBucket(rate=1000, burst=100)  # empty at t=0
    waits = [b.reserve(100, 0.0) for _ in range(3)]  # three downloads ask at once
    assert waits == [pytest.approx(0.1), pytest.approx(0.2), pytest.approx(0.3)]
    # Over a longer stretch the total stays at the rate: 30 chunks of 100 from 3 senders take 3 s.
    b = TokenBucket(rate=1000, burst=100)
    now, ready = 0.0, [0.0, 0.0, 0.0]
    for i in range(30):
        s = i % 3
        now = max(now, ready[s])
        ready[s] = now + b.reserve(100, now)
    assert max(ready) == pytest.approx(3.0)


def test_rate_zero_is_unlimited_and_a_new_rate_applies_from_then_on() -> None:
    b = TokenBucket.full(rate=0, burst=CHUNK, now=0.0)
    assert b.reserve(10**12, 0.0) == 0.0
    b.set_rate(1000, 100, now=5.0)  # limited from t=5, starting with a full burst
    assert b.reserve(100, 5.0) == 0.0 and b.reserve(100, 5.0) == pytest.approx(0.1)
    b.set_rate(2000, 100, now=5.0)  # what is owed stays owed, paid at the new rate
    assert b.reserve(100, 5.0) == pytest.approx(0.1)
    b.set_rate(0, 100, now=5.0)
    assert b.reserve(10**9, 5.0) == 0.0


def test_a_bucket_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        TokenBucket(rate=-1, burst=1)
    with pytest.raises(ValueError):
        TokenBucket(rate=1, burst=0)


def test_serving_counts_slots_up_to_the_concurrency() -> None:
    s = SnapshotServing.create(concurrency=2, rate_mb_s=64, now=0.0)
    assert s.try_start() and s.try_start()
    assert not s.try_start() and s.serving == 2
    s.finish()
    assert s.try_start() and not s.try_start()
    s.finish()
    s.finish()
    assert s.serving == 0
    with pytest.raises(RuntimeError):
        s.finish()


def test_a_lower_concurrency_lets_running_downloads_finish_but_starts_none() -> None:
    s = SnapshotServing.create(concurrency=3, rate_mb_s=64, now=0.0)
    assert all(s.try_start() for _ in range(3))
    s.configure(concurrency=1, rate_mb_s=64, now=1.0)
    assert s.serving == 3 and not s.try_start()
    s.finish()
    s.finish()
    assert not s.try_start()
    s.finish()
    assert s.try_start()


def test_serving_shares_one_bucket_at_the_configured_rate() -> None:
    s = SnapshotServing.create(concurrency=2, rate_mb_s=1, now=0.0)
    assert s.bucket.rate == 1 * MB
    chunk = s.chunk()
    end = send_all(s.bucket, [chunk] * 40, start=0.0)
    sent = 40 * chunk
    assert end == pytest.approx((sent - s.bucket.burst) / MB)
    s.configure(concurrency=2, rate_mb_s=0, now=end)
    assert s.reserve(10**12, end) == 0.0 and s.chunk() == CHUNK
    with pytest.raises(ValueError):
        s.configure(concurrency=0, rate_mb_s=1, now=end)


def test_a_chunk_is_at_most_a_quarter_second_share_of_the_rate() -> None:
    """A download waits for the others' chunks between two of its own; at a low
    rate and many downloads full chunks would starve it past its read timeout."""
    assert SnapshotServing.create(2, 64, 0.0).chunk() == CHUNK
    slow = SnapshotServing.create(2, 1, 0.0)
    assert slow.chunk() == MB // 8
    crowded = SnapshotServing.create(64, 1, 0.0)
    assert crowded.chunk() == MIN_CHUNK
    # each of 64 downloads waits for the 63 others' chunks: about a second, not 16 s
    assert 64 * crowded.chunk() / MB < 1.1
