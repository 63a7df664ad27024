"""Exactly-once writes survive a failover to a worker whose wall clock is far off.

A request id re-sent within the dedup window (10 minutes) must be answered
from the replicated dedup table with its original seq, never applied again,
whichever replica leads by then. Here w1 runs under libfaketime with its wall
clock moved (time.monotonic() left alone) from the start; group 1 is led by
w2. After increments with their own x-request-id, the followers catch up, w2
is SIGKILLed and meta names w1 (equal logs, the preferred leader dead: the
lowest id). Each entity's last acknowledged increment is then re-sent with the
same request id and body, as by a client that lost the response: it must come
back with its original seq, and every counter must count each acknowledged
increment once.
"""
from __future__ import annotations

import time
import urllib.error
import urllib.request
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

import orjson
import pytest

from tests.support.cluster import Cluster, wait_until
from topology.routing import shard_for

pytestmark = pytest.mark.tier3

FAKETIME_SO = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
GROUPS = [(0, "w1", ["w1", "w2", "w3"]), (1, "w2", ["w1", "w2", "w3"]), (2, "w3", ["w1", "w2", "w3"])]
GID = 1                 # led by w2, never by the skewed worker before the failover
SKEWED, OLD_LEADER = "w1", "w2"
ENTITIES, INCREMENTS, NEW_AFTER = 16, 10, 3
SIGNAL = "clicks"
OFFSETS = {"+15m": 15 * 60, "+2h": 2 * 3600}


def faketime_env(offset: str) -> dict[str, str]:
    if not FAKETIME_SO.exists():
        pytest.fail(f"{FAKETIME_SO} is missing: this test needs libfaketime, which .ci/run installs "
                    "(Debian package `libfaketime`: apt-get install -y libfaketime)")
    return {"LD_PRELOAD": str(FAKETIME_SO), "FAKETIME": offset, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}


@pytest.fixture(params=list(OFFSETS))
def skewed_cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Cluster, str]]:
    offset = request.param
    c = Cluster.create(tmp_path / "cluster", n_workers=3, n_gateways=1)
    c.worker_env[SKEWED] = faketime_env(offset)
    try:
        c.boot(c.topology_yaml(groups=GROUPS), gateways=True)
        yield c, offset
    finally:
        c.close()


def post_signal(gateway: str, entity: str, rid: str, timeout: float = 5.0) -> tuple[int, dict[str, str], Any]:
    """POST /signals (increment `SIGNAL` by 1) with x-request-id `rid`: status, headers, body."""
    req = urllib.request.Request(f"http://{gateway}/signals", method="POST",
                                 data=orjson.dumps({"entity": entity, "kind": SIGNAL, "value": 1}),
                                 headers={"x-request-id": rid, "content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, headers, raw = r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as err:
        status, headers, raw = err.code, dict(err.headers), err.read()
    headers = {k.lower(): v for k, v in headers.items()}
    try:
        return status, headers, orjson.loads(raw)
    except orjson.JSONDecodeError:
        return status, headers, raw.decode()


def increment(gateway: str, entity: str, rid: str, timeout: float = 20.0) -> tuple[int, Any]:
    """Send until acknowledged, always with the same rid (a failed attempt may have
    applied: only the same rid makes the retry safe). (seq, value) of the answer."""
    def attempt() -> tuple[int, Any] | None:
        status, headers, body = post_signal(gateway, entity, rid)
        if status != 200:
            return None
        assert headers.get("x-request-id") == rid, headers
        assert int(headers["x-seq"]) == body["seq"], (headers, body)
        return body["seq"], body["value"]
    return wait_until(attempt, timeout, f"increment {rid} of {entity} to be acknowledged", interval=0.1)  # type: ignore[no-any-return]


def counter(gateway: str, entity: str) -> int:
    req = urllib.request.Request(f"http://{gateway}/signals/{entity}", headers={"x-consistency": "strong"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return int(orjson.loads(r.read())["counters"].get(SIGNAL, 0))


def group_status(c: Cluster, wid: str) -> dict[str, Any]:
    return c.worker_status(wid)["groups"][str(GID)]  # type: ignore[no-any-return]


def meta_report(c: Cluster, wid: str) -> dict[str, Any]:
    """What the meta leader last heard from `wid` about group GID (what failover picks from)."""
    return c.view()["workers"][wid]["report"]["groups"][str(GID)]  # type: ignore[no-any-return]


def clock_skew_s(log: Path) -> float:
    """How far ahead of this process's clock the log's newest line is stamped."""
    now = time.time()
    for line in reversed(log.read_bytes().splitlines()):
        try:
            stamp = orjson.loads(line).get("timestamp")
        except orjson.JSONDecodeError:
            continue
        if stamp:
            return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() - now
    raise AssertionError(f"no timestamped line in {log}")


def test_retry_after_failover_to_a_skewed_clock_applies_once(skewed_cluster: tuple[Cluster, str]) -> None:
    c, offset = skewed_cluster
    gw = c.gateways[0]
    # The skew is real: w1 stamps its own log lines with the moved clock.
    skew = clock_skew_s(c.root / "logs" / f"{SKEWED}.log")
    assert abs(skew - OFFSETS[offset]) < 60, f"{SKEWED}'s clock is {skew:.0f}s off, not {offset}: is faketime in effect?"
    view = c.view()
    assert view["groups"][str(GID)]["leader"] == OLD_LEADER, view["groups"][str(GID)]

    entities = [e for e in (f"sk-{i}" for i in range(10_000)) if shard_for(e, 3) == GID][:ENTITIES]
    last: dict[str, tuple[str, int]] = {}  # entity -> (rid, seq) of its last acknowledged increment
    for n in range(INCREMENTS):
        for e in entities:
            rid = f"sk-{uuid.uuid4().hex}"
            seq, value = increment(gw, e, rid)
            assert value == n + 1, f"{e}: increment {n + 1} answered total {value}"
            last[e] = (rid, seq)

    # Quiesce: the followers hold and applied everything, and meta has heard so,
    # so that with equal logs the failover is meta's tie-break: the lowest id.
    def settled() -> bool:
        lead = group_status(c, OLD_LEADER)
        if lead["commit"] != lead["last_seq"]:
            return False
        for wid in (SKEWED, "w3"):
            mine = group_status(c, wid)
            rep = meta_report(c, wid)
            if not (mine["applied"] == lead["commit"] == mine["last_seq"] and mine["last_term"] == lead["last_term"]
                    and (rep["last_term"], rep["last_seq"]) == (lead["last_term"], lead["last_seq"])):
                return False
        return True
    wait_until(settled, 15.0, f"group {GID}'s followers to catch up and meta to hear it", interval=0.1)
    old_term = c.view()["groups"][str(GID)]["term"]

    c.kill(OLD_LEADER)

    def new_leader() -> str | None:
        g = c.view()["groups"][str(GID)]
        return g["leader"] if g["leader"] != OLD_LEADER and g["ready"] and g["term"] > old_term else None
    leader = wait_until(new_leader, 15.0, f"group {GID} to get a ready leader after SIGKILL of {OLD_LEADER}")
    assert leader == SKEWED, (f"setup is wrong: meta made {leader}, not {SKEWED}, the leader of group {GID} "
                              f"(the followers' logs were equal, so the lowest id should have won)")

    # The client lost each last response and re-sends it: same rid, same body.
    resent = {e: increment(gw, e, rid) for e, (rid, _) in last.items()}
    applied_again = {e: (last[e][1], seq) for e, (seq, _) in resent.items() if seq != last[e][1]}

    # Fresh increments under the new leader count once, and so do their retries.
    for e in entities[:NEW_AFTER]:
        rid = f"sk-{uuid.uuid4().hex}"
        first = increment(gw, e, rid)
        again = increment(gw, e, rid)
        assert again[0] == first[0], f"{e}: a retry right after a fresh increment got seq {again[0]}, not {first[0]}"

    expected = {e: INCREMENTS + (1 if e in entities[:NEW_AFTER] else 0) for e in entities}
    got = {e: counter(gw, e) for e in entities}
    off = {e: got[e] - expected[e] for e in entities if got[e] != expected[e]}
    print(f"\n[clock skew {offset}] {SKEWED} leads group {GID} after {OLD_LEADER}'s SIGKILL; "
          f"re-sent {len(last)}, applied again {len(applied_again)}; counters off: {off or 'none'}")
    assert not applied_again and not off, (
        f"{len(applied_again)} of {len(last)} re-sent increments were applied again after the failover to "
        f"{SKEWED} (clock {offset}) instead of being answered from the dedup table (original seq, new seq): "
        f"{dict(list(applied_again.items())[:4])}; counters off by {off} (expected {INCREMENTS}, "
        f"+1 for the {NEW_AFTER} entities with a fresh increment)")
