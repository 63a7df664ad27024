"""Scenario 3 of the chaos gate, run INSIDE a private network namespace.

`ip netns exec NS python -m tests.tier3.partition_run --root DIR` starts a
cluster whose processes listen on distinct loopback addresses (meta
127.0.0.21-23, workers 127.0.0.11-13 with their outgoing connections bound to
those addresses, gateways 127.0.0.31-32), runs the load, partitions the
leader of group 0 from its followers and from meta with nftables rules on
`lo` (the gateways still reach it), waits for the new term, heals, checks
that the old leader stepped down, and judges the history. It prints one JSON
line of figures and exits non-zero on any failure. The namespace is private,
so fixed ports cannot collide and the rules touch nothing outside it.

`--scenario` picks the fault; the default, `leader-followers-meta`, is the one
above. The others are the issue "an isolated leader holds its shard down":
the leader of group 0 loses its followers but keeps meta and the gateways.

  leader-followers  the leader is cut from its followers, both directions
  asymmetric-out    only the leader's packets to its followers are dropped
  asymmetric-in     only the followers' packets to the leader are dropped

Each passes when writes to shard 0 resume within RESUME_LIMIT_S of the cut
(the first acknowledged write or increment of an entity routed to shard 0
that was sent after the cut), meta names a new ready leader at a higher
term, after the heal the old leader follows the new term, and the history
is complete and linearizable. UDP probes check that the rules drop exactly
the scenario's directions.

  flapping          the link between group 0's leader and its followers is
                    cut for 1 s and healed for 1 s, for 20 s; each cut
                    isolates whoever leads group 0 at that moment. Passes when
                    the history is complete and linearizable and group 0
                    changed leader (meta's term, polled every 100 ms) at most
                    20 s // --window + 1 times (4 with the default 6 s window).
  flapping-slow     the same with 2.5 s cuts and 1 s heals: each cut outlasts
                    the lease (1.5 s), so each would move the leadership but
                    for the controller's decision window (4 leases = 6 s).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from tests.support.cluster import Cluster, MetaSpec, wait_until
from tests.support.history import check_acknowledged, check_linearizable
from tests.support.load import LoadGenerator, LoadResult, final_state
from shardgrid.common.auth import write_secret
from shardgrid.health import assess
from tests.tier3.test_chaos import GROUPS, Background
from topology.routing import shard_for

TABLE = "sgpartition"


def nft(script: str) -> None:
    subprocess.run(["nft", "-f", "-"], input=script, text=True, check=True)


def partition(victim_ip: str, others: list[str]) -> None:
    peers = ", ".join(others)
    # Match on addresses (not connection state): connections opened before
    # the rule must be cut too (see shared TESTING.md).
    nft(f"""table inet {TABLE} {{
  chain out {{
    type filter hook output priority 0; policy accept;
    ip saddr {victim_ip} ip daddr {{ {peers} }} drop
    ip saddr {{ {peers} }} ip daddr {victim_ip} drop
  }}
}}
""")


def heal() -> None:
    subprocess.run(["nft", "delete", "table", "inet", TABLE], check=False)


def build(root: Path) -> Cluster:
    meta = [MetaSpec(f"m{i}", f"127.0.0.2{i}:7001", f"127.0.0.2{i}:7101") for i in (1, 2, 3)]
    workers = [(f"w{i}", f"127.0.0.1{i}:7201", "abc"[i - 1]) for i in (1, 2, 3)]
    root.mkdir(parents=True, exist_ok=True)
    write_secret(root / "cluster.secret", "partition-secret")
    c = Cluster(root, meta, workers, gateways=["127.0.0.31:8080", "127.0.0.32:8080"])
    c.source = {w: h.split(":")[0] for w, h, _ in workers}
    return c


def run(root: Path) -> dict[str, object]:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    heal()
    c = build(root)
    try:
        c.boot(c.topology_yaml(snapshot_every=500, groups=GROUPS), gateways=True)
        load = Background(LoadGenerator(c.gateways, clients=8, ops_per_client=100_000, seed=31))
        try:
            load.wait_more(300)
            before = c.view()["groups"]["0"]
            victim = before["leader"]
            victim_ip = c.source[victim]
            others = [ip for w, ip in c.source.items() if w != victim] + [m.http.split(":")[0] for m in c.meta]
            partition(victim_ip, others)
            cut = time.monotonic()
            wait_until(lambda: (g := c.view()["groups"]["0"])["term"] > before["term"] and g["ready"], 15.0,
                       "group 0 to get a new ready leader while its old leader is cut off", interval=0.05)
            failover = time.monotonic() - cut
            load.wait_more(300)
            heal()
            new_term = c.view()["groups"]["0"]["term"]
            wait_until(lambda: (g := c.worker_status(victim)["groups"]["0"])["term"] >= new_term
                       and g["role"] != "leader", 15.0, f"old leader {victim} to step down after the heal")
            load.wait_more(200)
        finally:
            heal()
            result = load.finish()
        items, counters = asyncio.run(final_state(c.gateways[0], result))
        acked = check_acknowledged(result.history, items, counters)
        lin = check_linearizable(result.history)
        return {"ok": acked.ok and lin.ok, "victim": victim, "failover_s": round(failover, 2),
                "summary": result.summary(), "acknowledged": acked.summary(), "linearizable": lin.summary(),
                "details": "" if acked.ok and lin.ok else acked.details() + lin.details()}
    finally:
        c.close()


# -- the isolated-leader scenarios (leader cut from its followers only) ------------------------------

DEFAULT_SCENARIO = "leader-followers-meta"
SHARDS = 3
# Writes to shard 0 must be acknowledged again this soon after the cut.
RESUME_LIMIT_S = 5.0
# How long the cut is held waiting for a new leader (and for writes to shard 0)
# before the scenario calls it failed; the same bound as the scenario above.
CUT_WAIT_S = 15.0
SEEDS = {"leader-followers": 32, "asymmetric-out": 33, "asymmetric-in": 34, "flapping": 35}

Pairs = list[tuple[list[str], list[str]]]

# scenario -> (leader IP, follower IPs) -> (sources, destinations) whose packets are dropped.
CUTS: dict[str, Callable[[str, list[str]], Pairs]] = {
    "leader-followers": lambda leader, followers: [([leader], followers), (followers, [leader])],
    "asymmetric-out": lambda leader, followers: [([leader], followers)],
    "asymmetric-in": lambda leader, followers: [(followers, [leader])],
}


def block(pairs: Pairs) -> None:
    """One drop rule per (sources, destinations) pair, each for one direction only."""
    rules = "\n".join(f"    ip saddr {{ {', '.join(src)} }} ip daddr {{ {', '.join(dst)} }} drop"
                      for src, dst in pairs)
    nft(f"""table inet {TABLE} {{
  chain out {{
    type filter hook output priority 0; policy accept;
{rules}
  }}
}}
""")


def unblock() -> None:
    """heal() without nft's complaint when there is no table (the flapping loop heals often)."""
    subprocess.run(["nft", "delete", "table", "inet", TABLE], check=False, capture_output=True)


def passes(src: str, dst: str, timeout: float = 0.3) -> bool:
    """Does a datagram from address `src` reach address `dst` now? (The rules match any protocol.)"""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
        rx.bind((dst, 0))
        rx.settimeout(timeout)
        tx.bind((src, 0))
        try:
            tx.sendto(b"probe", rx.getsockname())
            return rx.recv(16) == b"probe"
        except OSError:  # EPERM: dropped on output; timeout: never arrived
            return False


def check_cut(scenario: str, leader: str, followers: list[str], meta: list[str]) -> list[str]:
    """Where the installed rules differ from what the scenario means to cut ([] when they match)."""
    out_cut = scenario in ("leader-followers", "asymmetric-out")
    in_cut = scenario in ("leader-followers", "asymmetric-in")
    expect = [(leader, f, not out_cut) for f in followers] + [(f, leader, not in_cut) for f in followers]
    expect += [(leader, m, True) for m in meta] + [(m, leader, True) for m in meta]
    # Gateways dial from 127.0.0.1 (they bind no source address); the test's probes do too.
    expect += [("127.0.0.1", leader, True), (leader, "127.0.0.1", True)]
    expect += [(a, b, True) for a in followers for b in followers if a != b]
    return [f"{s} -> {d}: {'passes' if not ok else 'dropped'}, expected {'passes' if ok else 'dropped'}"
            for s, d, ok in expect if passes(s, d) != ok]


class ShardAcks:
    """Acknowledged writes and increments to one shard, read from a load generator's live history."""

    def __init__(self, result: LoadResult, shard: int = 0) -> None:
        self.result, self.shard = result, shard
        self._shard_of: dict[str, int] = {}

    def _routes_here(self, key: str, kind: str) -> bool:
        s = self._shard_of.get(key)
        if s is None:
            # An item's key is its entity id; an increment's key is "<entity>/<kind>".
            entity = self.result.counters.get(key, key.rsplit("/", 1)[0]) if kind == "incr" else key
            s = self._shard_of[key] = shard_for(entity, SHARDS)
        return s == self.shard

    def completions(self, sent_after: float) -> list[float]:
        """Completion times, sorted, of those sent at or after `sent_after` (an operation sent
        before a cut may have been replicated before it, so it proves nothing about after)."""
        return sorted(op.complete for op in self.result.history.ops
                      if op.kind in ("write", "incr") and op.acked and op.complete is not None
                      and op.invoke >= sent_after and self._routes_here(op.key, op.kind))

    def first(self, sent_after: float) -> float | None:
        done = self.completions(sent_after)
        return done[0] if done else None


def stepped_down(c: Cluster, victim: str, new_term: int) -> bool:
    """The old leader follows a term at least as new as the failover's; leading again is
    fine only at a later term that meta gave it (leader balance may hand it back)."""
    mine = c.worker_status(victim)["groups"]["0"]
    if mine["term"] < new_term:
        return False
    if mine["role"] == "follower":
        return True
    g = c.view()["groups"]["0"]
    return bool(mine["term"] > new_term and g["leader"] == victim and g["term"] == mine["term"])


def judge_history(c: Cluster, result: LoadResult, out: dict[str, Any], failed: list[str]) -> None:
    items, counters = asyncio.run(final_state(c.gateways[0], result))
    acked = check_acknowledged(result.history, items, counters)
    lin = check_linearizable(result.history)
    out.update(summary=result.summary(), errors=dict(result.errors), acknowledged=acked.summary(),
               linearizable=lin.summary())
    if not acked.ok:
        failed.append("acknowledged: " + acked.details()[:3000])
    if not lin.ok:
        failed.append("linearizable: " + lin.details()[:3000])


def run_isolated_leader(root: Path, scenario: str, out: dict[str, Any]) -> None:
    """leader-followers, asymmetric-out, asymmetric-in: fills `out` as figures come in."""
    failed: list[str] = out.setdefault("failed", [])
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    unblock()
    c = build(root)
    try:
        c.boot(c.topology_yaml(snapshot_every=500, groups=GROUPS), gateways=True)
        load = Background(LoadGenerator(c.gateways, clients=8, ops_per_client=100_000, seed=SEEDS[scenario]))
        acks = ShardAcks(load.gen.result, 0)
        try:
            load.wait_more(300)
            groups_before = c.view()["groups"]
            before = groups_before["0"]
            victim = before["leader"]
            followers = [c.source[w] for w in before["voters"] if w != victim]
            out.update(victim=victim, term_before=before["term"])
            block(CUTS[scenario](c.source[victim], followers))
            cut = time.monotonic()
            # Probe the rules from a thread: the figures below are timed from `cut`.
            wrong: list[str] = []
            prober = threading.Thread(target=lambda: wrong.extend(check_cut(
                scenario, c.source[victim], followers, [m.http.split(":")[0] for m in c.meta])), daemon=True)
            prober.start()

            seen: dict[str, Any] = {}

            def failed_over_and_resumed() -> bool:
                if "resume" not in seen and (t := acks.first(cut)) is not None:
                    seen["resume"] = t - cut
                if "failover" not in seen:
                    g = c.view()["groups"]["0"]
                    if g["term"] > before["term"] and g["ready"]:
                        seen["failover"] = (time.monotonic() - cut, g)
                return "resume" in seen and "failover" in seen

            try:
                wait_until(failed_over_and_resumed, CUT_WAIT_S, "", interval=0.05)
            except AssertionError:
                pass
            prober.join(10)
            if wrong:
                raise AssertionError("the partition is not the scenario's: " + "; ".join(wrong))
            resume = seen.get("resume")
            out["resume_s"] = None if resume is None else round(resume, 2)
            if resume is None:
                failed.append(f"no write to shard 0 acknowledged within {CUT_WAIT_S:.0f} s of the cut")
            elif resume > RESUME_LIMIT_S:
                failed.append(f"writes to shard 0 resumed {resume:.2f} s after the cut (limit {RESUME_LIMIT_S} s)")
            if "failover" in seen:
                took, g = seen["failover"]
                out.update(failover_s=round(took, 2), new_leader=g["leader"], new_term=g["term"])
                load.wait_more(300)  # the new leader serves under the partition
                # Only the isolated leadership moves: in the groups the victim follows, its
                # silence alone (one voter of three) changes nothing.
                moved = {gid: (gb["leader"], gb["term"], ga["leader"], ga["term"])
                         for gid, ga in c.view()["groups"].items() if gid != "0"
                         for gb in [groups_before[gid]] if (ga["leader"], ga["term"]) != (gb["leader"], gb["term"])}
                out["other_groups_moved"] = moved
                if moved:
                    failed.append(f"groups other than 0 changed leader or term under the cut: {moved}")
                if scenario != "asymmetric-out":  # (there the old leader still hears the new one)
                    # What an operator sees: topoctl status's verdict names the old leader's
                    # replica of group 0 as one that cannot serve (cut off, unheard by its leader).
                    def shown() -> list[tuple[str, int, str, str]] | None:
                        rows = [(r.worker, r.group, r.state, r.why) for r in assess(c.view()).replicas
                                if (r.worker, r.group) == (victim, 0) and not r.serving]
                        return rows or None
                    try:
                        out["status_shows"] = wait_until(shown, 5.0, "", interval=0.1)
                    except AssertionError:
                        failed.append(f"topoctl status does not list {victim} as cut off from group 0's leader")
            else:
                g = c.view()["groups"]["0"]
                out.update(failover_s=None, view_at_end_of_cut={k: g[k] for k in ("leader", "term", "ready")})
                failed.append(f"no new ready leader of group 0 within {CUT_WAIT_S:.0f} s of the cut "
                              f"(meta names {g['leader']} at term {g['term']}, ready={g['ready']})")
            unblock()
            healed = time.monotonic()
            recovered = False
            try:
                if "failover" in seen:
                    new_term = c.view()["groups"]["0"]["term"]
                    try:
                        wait_until(lambda: stepped_down(c, victim, new_term), 15.0, "", interval=0.05)
                        out["stepdown_after_heal_s"] = round(time.monotonic() - healed, 2)
                    except AssertionError:
                        st = c.worker_status(victim)["groups"]["0"]
                        failed.append(f"old leader {victim} did not step down within 15 s of the heal "
                                      f"(it reports term {st['term']} role {st['role']}; meta's term is {new_term})")
                recovered = writes_resume(load, acks, healed, "heal", out, failed)
            except AssertionError as exc:
                failed.append(f"after the heal: {exc}")
        finally:
            unblock()
            result = load.finish()
        judge_if_recovered(c, result, recovered, "heal", out, failed)
    finally:
        c.close()


def writes_resume(load: Background, acks: "ShardAcks", since: float, what: str, out: dict[str, Any],
                  failed: list[str]) -> bool:
    """Writes to shard 0 are acknowledged again after `since` (the end of the
    fault), and the load goes on: True, with the delay in `out`."""
    try:
        wait_until(lambda: acks.first(since), 20.0, f"writes to shard 0 after the {what}")
    except AssertionError as exc:
        failed.append(f"after the {what}: {exc}")
        return False
    out[f"resume_after_{what}_s"] = round(acks.first(since) - since, 2)  # type: ignore[operator]
    load.wait_more(200)
    return True


def judge_if_recovered(c: Cluster, result: LoadResult, recovered: bool, what: str, out: dict[str, Any],
                       failed: list[str]) -> None:
    if recovered:
        judge_history(c, result, out, failed)
    else:
        out.update(summary=result.summary(), errors=dict(result.errors))
        failed.append(f"history not judged: the cluster did not recover after the {what}")


class TermPoller(threading.Thread):
    """Group 0's (time, term, leader, voters) in meta's view, every `interval` seconds."""

    def __init__(self, c: Cluster, interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.c, self.interval = c, interval
        self.stop = threading.Event()
        self.seen: list[tuple[float, int, str, list[str]]] = []
        self.errors = 0
        self.poll()
        assert self.seen, "meta's view could not be read before the flapping started"

    def poll(self) -> None:
        try:
            g = self.c.view()["groups"]["0"]
        except (OSError, AssertionError, KeyError, ValueError):
            self.errors += 1
            return
        self.seen.append((time.monotonic(), int(g["term"]), str(g["leader"]), list(g["voters"])))

    def latest(self) -> tuple[float, int, str, list[str]]:
        return self.seen[-1]

    def run(self) -> None:
        due = time.monotonic()
        while not self.stop.is_set():
            self.poll()
            due += self.interval
            self.stop.wait(max(0.0, due - time.monotonic()))


def sleep_until(at: float) -> None:
    """The fault schedule's clock (not a wait for a condition): absolute, so it does not drift."""
    time.sleep(max(0.0, at - time.monotonic()))


def run_flapping(root: Path, out: dict[str, Any], window: float, duration: float = 20.0,
                 cut_s: float = 1.0, heal_s: float = 1.0) -> None:
    failed: list[str] = out.setdefault("failed", [])
    limit = int(duration // window) + 1
    out.update(window_s=window, duration_s=duration, cut_s=cut_s, heal_s=heal_s, max_changes=limit)
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    unblock()
    c = build(root)
    try:
        c.boot(c.topology_yaml(snapshot_every=500, groups=GROUPS), gateways=True)
        load = Background(LoadGenerator(c.gateways, clients=8, ops_per_client=100_000, seed=SEEDS["flapping"]))
        acks = ShardAcks(load.gen.result, 0)
        try:
            load.wait_more(300)
            poller = TermPoller(c)
            first_term = poller.latest()[1]
            victims: list[str] = []
            start = time.monotonic()
            poller.start()
            try:
                k = 0
                while (at := start + k * (cut_s + heal_s)) < start + duration:
                    sleep_until(at)
                    _, _, leader, voters = poller.latest()  # whoever leads group 0 now (<= 100 ms old)
                    block(CUTS["leader-followers"](c.source[leader], [c.source[w] for w in voters if w != leader]))
                    victims.append(leader)
                    sleep_until(min(at + cut_s, start + duration))
                    unblock()
                    k += 1
                sleep_until(start + duration)
            finally:
                unblock()
                poller.stop.set()
                poller.join(5)
            end = time.monotonic()
            terms = [term for t, term, _, _ in poller.seen if t <= end]
            # Meta's term rises by one per leadership change (set_leader), so the rise counts
            # changes even when two fall between polls; a poll answered by a lagging meta
            # follower cannot lower it.
            changes = max(terms) - first_term
            out.update(changes=changes, polled_transitions=sum(1 for a, b in zip(terms, terms[1:]) if a != b),
                       terms_seen=sorted(set(terms)),
                       leaders_seen=list(dict.fromkeys(ld for t, _, ld, _ in poller.seen if t <= end)),
                       victims=victims, polls=len(terms), poll_errors=poller.errors)
            if changes > limit:
                failed.append(f"group 0 changed leader {changes} times in {duration:.0f} s of flapping "
                              f"(at most {limit} with a {window:g} s window)")
            during = [t for t in acks.completions(start) if t <= end]
            marks = [start, *during, end]
            out.update(shard0_acked_while_flapping=len(during),
                       shard0_longest_gap_s=round(max(b - a for a, b in zip(marks, marks[1:])), 2))
            recovered = False
            try:
                c.wait_groups_ready(timeout=30)
                recovered = writes_resume(load, acks, end, "flapping", out, failed)
            except AssertionError as exc:
                failed.append(f"after the flapping: {exc}")
        finally:
            unblock()
            result = load.finish()
        judge_if_recovered(c, result, recovered, "flapping", out, failed)
    finally:
        c.close()


# Flapping scenarios: (cut, heal) in seconds.
FLAPS = {"flapping": (1.0, 1.0), "flapping-slow": (2.5, 1.0)}
SCENARIOS = [DEFAULT_SCENARIO, *CUTS, *FLAPS]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--scenario", choices=SCENARIOS, default=DEFAULT_SCENARIO)
    ap.add_argument("--window", type=float, default=6.0,
                    help="flapping: the controller's decision window in seconds; group 0 may change leader "
                         "at most 20 s // window + 1 times")
    args = ap.parse_args()
    if args.scenario == DEFAULT_SCENARIO:
        try:
            out = run(Path(args.root))
        except AssertionError as exc:
            out = {"ok": False, "details": str(exc)}
        print(json.dumps(out))
        return 0 if out["ok"] else 1
    out = {"scenario": args.scenario}
    try:
        if args.scenario in FLAPS:
            cut_s, heal_s = FLAPS[args.scenario]
            run_flapping(Path(args.root), out, window=args.window, cut_s=cut_s, heal_s=heal_s)
        else:
            run_isolated_leader(Path(args.root), args.scenario, out)
    except AssertionError as exc:
        out.setdefault("failed", []).append(f"harness: {exc}")
    failed = out.get("failed", [])
    out["ok"] = not failed
    out["details"] = "\n".join(failed)
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
