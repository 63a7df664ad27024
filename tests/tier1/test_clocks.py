"""Every timer runs on the monotonic clock; the wall clock is only ever data.

Leases, deadlines, heartbeats, retries and entry timestamps (log time, see
worker/replica.py) must not move when a wall clock is stepped or skewed
(runbook/operations.md, "Request ids and the dedup window"). This holds the
servers' sources to it: a read of the wall clock is allowed only where it is
data, each named here with why.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVERS = ("meta", "worker", "gateway", "topology", "shardgrid")
WALL_CLOCK = re.compile(r"\btime\.time(_ns)?\(|\bdatetime\.(now|utcnow|today)\(|\bdate\.today\(")
# (file, a fragment of the line): why reading the wall clock there is data, not a timer.
ALLOWED = {
    ("meta/server.py", '"started_ms": int(time.time() * 1000)'): "when an operator started, shown to operators",
    ("worker/process.py", ".removed-{int(time.time())}"): "a removed replica's tombstone directory name",
    ("meta/server.py", '"at_unix_ms": int(time.time() * 1000)'): "when an admission was refused, shown to operators",
    ("shardgrid/common/tls.py", "now = datetime.datetime.now(datetime.timezone.utc)"): "the validity dates of the dev "
    "certificates (`shardgrid dev --tls`): X.509 dates are wall-clock data",
}


def wall_clock_reads() -> list[tuple[str, str]]:
    found = []
    for pkg in SERVERS:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("shardgrid/bench"):
                continue  # the benchmark tool is a client: it times runs, it keeps no lease
            for line in path.read_text(encoding="utf-8").splitlines():
                if WALL_CLOCK.search(line) and not line.lstrip().startswith("#"):
                    found.append((rel, line.strip()))
    return found


def test_servers_read_the_wall_clock_only_as_data() -> None:
    unexplained = [(f, line) for f, line in wall_clock_reads()
                   if not any(f == af and frag in line for af, frag in ALLOWED)]
    assert unexplained == [], ("wall-clock reads in server code: use time.monotonic() (or the event loop's "
                               f"time) for timers, or name the read in ALLOWED with why it is data: {unexplained}")


def test_the_check_sees_a_wall_clock_read() -> None:
    assert WALL_CLOCK.search("deadline = time.time() + 5") and WALL_CLOCK.search("now = time.time_ns()")
    assert not WALL_CLOCK.search("deadline = time.monotonic() + 5")
    assert all(any(f == af and frag in line for f, line in wall_clock_reads()) for af, frag in ALLOWED), \
        "an ALLOWED entry matches nothing any more: remove it"
