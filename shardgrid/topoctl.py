"""topoctl: the operator's command line for a shardgrid cluster.

    topoctl apply FILE [--dry-run]   validate, print the plan, apply it (compare-and-set);
                                     --dry-run also prints the live cluster's drift from FILE
    topoctl status [--wait-for green|yellow]
                                     the verdict (green, yellow, red) and why, then meta nodes,
                                     groups, per-replica lag, workers, drift from the file
    topoctl get                      the applied topology YAML
    topoctl transfer SHARD [--to W]  move a group's leadership (graceful, fenced)
    topoctl replicas SHARD --add W | --remove W
                                     staged replica change, with progress until done
    topoctl operators                placement changes in progress
    topoctl completion bash          a bash completion script (source it, or put it in
                                     /etc/bash_completion.d/topoctl)

Global options (--meta, --timeout, --admin-token-file, --tls-ca, -o/--output,
--json) go before or after the verb. `-o table|json|yaml` picks the output
of every verb; in json and yaml stdout carries one document and progress
lines go to stderr. `--json` is `-o json`.

Meta addresses come from --meta or SHARDGRID_META (comma-separated host:port).
With --tls-ca or SHARDGRID_TLS_CA, host:port addresses are dialled over https
and meta must present a certificate that CA signed for the address; an address
given as http:// is then refused (exit 1), so the admin token never goes in clear.
When a verb fails under json or yaml (meta unreachable, a rejection, a wait
that gives up), that document is `{"error": {"code", "message", "exit", ...}}`.
Exit codes: 0 ok, 1 rejected (invalid file, conflict, refused), 2 usage (argparse),
3 no meta node answered, 4 applied or draining but not converged when the wait
ended; `topoctl status`: 0 green, 5 yellow, 6 red. With --wait-for: 0 once the
verdict has held over lease_ms plus one report period; at --timeout, 4 if it
was reached but had not held that long, else the last verdict's code (the last
answer's, when a later try failed), or 3 only when no try answered at all.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import yaml

from meta.client import MetaClient, MetaError, MetaUnreachable
from shardgrid.common.auth import SecretFileError, read_secret
from shardgrid.common.identity import code_digest, package_version
from shardgrid.health import Health, Verdict, assess, lease_ms, progress_key, render_health, software
from shardgrid.drift import drift, render_apply_drift, render_drift
from shardgrid.common.tls import CA_ENV, TlsConfigError, client_context
from shardgrid.common.units import format_bytes
from topology.errors import TopologyError
from topology.loader import load_topology
from topology.model import model_groups

DEFAULT_META = "127.0.0.1:7101,127.0.0.1:7102,127.0.0.1:7103"
EXIT_REJECTED = 1
EXIT_UNREACHABLE = 3
EXIT_NOT_CONVERGED = 4  # applied, but the cluster had not converged when the wait ended
# `topoctl status` by verdict. Not 1-4: those already say rejected, usage
# (argparse), meta unreachable and not converged, and a script must tell
# "the cluster is red" from "topoctl could not ask".
EXIT_YELLOW = 5
EXIT_RED = 6
VERDICT_EXIT = {Verdict.GREEN: 0, Verdict.YELLOW: EXIT_YELLOW, Verdict.RED: EXIT_RED}
POLL_S = 0.5
META_DEADLINE_S = 10.0  # --timeout's default for one call to meta
WAIT_FOR_DEFAULT_S = 300.0  # --timeout's default for `status --wait-for`
WAIT_FOR_POLL_S = 1.0
OUTPUTS = ("table", "json", "yaml")


def _out(line: str = "") -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _err(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _format(args: argparse.Namespace) -> str:
    return str(getattr(args, "output", None) or "table")


def _progress(args: argparse.Namespace) -> Callable[[str], None]:
    """Where lines that are not the result go: stdout for a person, stderr when
    stdout must hold one parseable document."""
    return _out if _format(args) == "table" else _err


def plain(doc: Any) -> Any:
    """`doc` as JSON sees it (string keys, lists for tuples, enum values): json and yaml print the same data."""
    return orjson.loads(orjson.dumps(doc, option=orjson.OPT_NON_STR_KEYS))


def dump(doc: Any, fmt: str) -> str:
    if fmt == "yaml":
        return yaml.safe_dump(plain(doc), sort_keys=False, allow_unicode=True).rstrip("\n")
    return orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode()


def _error_doc(args: argparse.Namespace, code: int, error: str, message: str, **detail: Any) -> int:
    """A verb that gives up, as -o json|yaml's one document on stdout (`{"error": {...}}`;
    what it says went to stderr too), so a script parsing stdout always has one document.
    Returns `code`."""
    if _format(args) != "table":
        _out(dump({"error": {"code": error, "message": message, "exit": code, **detail}}, _format(args)))
    return code


def _emit(args: argparse.Namespace, doc: Any, table: Callable[[], Sequence[str]]) -> None:
    """The verb's result: `table()` lines for a person, `doc` for json and yaml."""
    fmt = _format(args)
    if fmt == "table":
        for line in table():
            _out(line)
    else:
        _out(dump(doc, fmt))


class _Client(MetaClient):
    """MetaClient that, holding a token but no CA, first checks that meta speaks plain http.

    With a CA, MetaClient refuses http:// addresses outright. Without one, an
    operator who forgot --tls-ca against an HTTPS cluster would write the token
    in clear onto the wire (the server then only fails the handshake): a
    tokenless GET first fails instead, and the token is never sent."""

    async def __aenter__(self) -> "_Client":
        if self.admin_token is not None and self.tls is None and any(a.startswith("http://") for a in self.addrs):
            await self.request("GET", "/healthz")  # MetaUnreachable: exit 3, with the --tls-ca hint
        return self


def _meta_deadline(args: argparse.Namespace) -> float:
    timeout = getattr(args, "timeout", None)
    return META_DEADLINE_S if timeout is None else float(timeout)


def _client(args: argparse.Namespace, deadline_s: float | None = None) -> _Client:
    addrs = [a.strip() for a in args.meta.split(",") if a.strip()]
    token = read_secret(args.admin_token_file, "SHARDGRID_ADMIN_TOKEN")
    tls = client_context(Path(args.tls_ca)) if args.tls_ca else None
    return _Client(addrs, admin_token=token, deadline_s=_meta_deadline(args) if deadline_s is None else deadline_s,
                   tls=tls)


# -- apply ---------------------------------------------------------------------

async def cmd_apply(args: argparse.Namespace) -> int:
    doc: dict[str, Any] = {}
    code = await _apply(args, _progress(args), doc)
    if _format(args) != "table" and doc:
        _out(dump(doc, _format(args)))
    return code


async def _apply(args: argparse.Namespace, say: Callable[[str], None], doc: dict[str, Any]) -> int:
    """apply, saying what it does; `doc` collects the result for -o json|yaml."""
    path = Path(args.file)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        _err(f"topoctl: cannot read {path}: {exc.strerror}")
        return _error_doc(args, EXIT_REJECTED, "unreadable", f"cannot read {path}: {exc.strerror}")
    try:
        topo = load_topology(raw)  # offline check first: errors even when meta is down
    except TopologyError as err:
        _err(f"topoctl: {path} is invalid; nothing was applied:")
        for e in err.errors:
            _err(f"  {e.path or '<root>'}: {e.message}")
        return _error_doc(args, EXIT_REJECTED, "invalid", f"{path} is invalid; nothing was applied",
                          errors=[{"path": e.path, "message": e.message} for e in err.errors])
    text = raw.decode("utf-8")
    async with _client(args) as client:
        preview = await client.put_topology(text, dry_run=True)
        doc.update(plan=preview, applied=None)
        say(f"plan against topology revision {preview['topology_revision']}:")
        for line in preview["plan_text"].splitlines():
            say(f"  {line}")
        if args.dry_run:
            for line in render_apply_drift(topo.to_dict(), await leader_view(client)):
                say(line)
        if not preview["changed"]:
            # Moves in the plan of an unchanged file: meta already steers there
            # (after an earlier apply), waiting for a worker or a step.
            say("topology unchanged: nothing to apply" + (
                " (the controller already steers toward it; topoctl status shows the drift)"
                if preview.get("plan") else ""))
            return 0
        if args.dry_run:
            say("dry run: nothing applied")
            return 0
        result = await client.put_topology(text, expect_revision=preview["topology_revision"])
        doc["applied"] = result
        say(f"applied: topology revision {result['topology_revision']} (cluster revision {result.get('revision')})")
        moves = [a for a in preview.get("plan", []) if a.get("kind") in ("add_replica", "remove_replica",
                                                                          "move_leader")]
        if args.no_wait:
            return 0
        if not moves:
            # New groups (or settings): nothing live moves. A new group gets
            # its leader when its workers start.
            return 0
        say(f"following {len(moves)} move(s) until the cluster converges (--no-wait to return now):")
        code = await follow_convergence(client, args.wait, say=say)
        doc["converged"] = code == 0
        return code


def pending(view: dict[str, Any]) -> dict[str, str]:
    """What keeps each group from its desired state, by group id (empty: converged).

    A group has converged when its voters are its desired placement, it has
    no learner and no operator, it has a ready leader, and that leader is its
    preferred one (leader balance moves it there once the worker has been up
    and caught up for a while)."""
    out: dict[str, str] = {}
    ops = view.get("operators") or {}
    for gid, g in sorted(view["groups"].items(), key=lambda kv: int(kv[0])):
        op = ops.get(str(gid)) or ops.get(gid)
        desired = g.get("desired") or []
        if op is not None:
            out[str(gid)] = operator_text(op)
        elif desired and sorted(g["voters"]) != sorted(desired):
            out[str(gid)] = f"voters {','.join(g['voters'])}, desired {','.join(desired)}: waiting for a step to start"
        elif g["learners"]:
            out[str(gid)] = f"learners {','.join(g['learners'])} to promote or remove"
        elif not g["ready"]:
            out[str(gid)] = "no ready leader"
        elif g.get("preferred_leader") and g["leader"] != g["preferred_leader"]:
            out[str(gid)] = f"leader {g['leader']}, preferred {g['preferred_leader']}: leader balance moves it " \
                            "once that worker is caught up"
    return out


def operator_text(op: dict[str, Any]) -> str:
    """One operator as a follow line shows it: `add w4: catch_up: w4 receiving snapshot: 12 MB of 40 MB (30%)`."""
    return f"{op['kind']} {op['worker']}: {op['step']}" + (f": {op['message']}" if op["message"] else "")


async def follow_convergence(client: MetaClient, wait_s: float, say: Callable[[str], None] = _out) -> int:
    """Say each group's progress until every group has converged (0), or
    the wait ends (EXIT_NOT_CONVERGED; nothing is cancelled)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    shown: dict[str, str] = {}
    while True:
        view = await client.cluster()
        now = pending(view)
        for gid, what in now.items():
            if shown.get(gid) != what:
                say(f"  group {gid}: {what}")
        for gid in sorted(set(shown) - set(now), key=int):
            g = view["groups"][gid]
            say(f"  group {gid}: converged (voters {','.join(g['voters'])}; leader {g['leader']})")
        shown = now
        if not now:
            say("converged")
            return 0
        if loop.time() > deadline:
            _err(f"topoctl: applied, but not converged after {wait_s:.0f} s: {len(now)} group(s) still moving "
                 "(topoctl operators, topoctl status); nothing was cancelled")
            return EXIT_NOT_CONVERGED
        await asyncio.sleep(POLL_S)


# -- status ----------------------------------------------------------------------

LEADER_REASK_S = 3.0  # the most the second ask, at the meta leader itself, may take
NODE_STATUS_S = 2.0  # the most one meta node's own /v1/status may take


async def leader_view(client: MetaClient, deadline_s: float | None = None) -> dict[str, Any]:
    """The cluster view, from the meta leader when it answers: only it holds
    the workers' heartbeat reports (liveness, replica health). Both asks fit in
    `deadline_s` (None: the client's own deadline for the first)."""
    end = None if deadline_s is None else time.monotonic() + deadline_s
    view = await client.cluster(deadline_s=deadline_s)
    nodes = view.get("meta", [])
    leader_http = next((n["http"] for n in nodes if n["id"] == view.get("meta_leader")), None)
    if leader_http and view.get("served_by") != view.get("meta_leader"):
        left = LEADER_REASK_S if end is None else min(LEADER_REASK_S, end - time.monotonic())
        if left > 0:
            client.prefer(leader_http)
            try:
                view = await client.cluster(deadline_s=left)
            except (MetaUnreachable, MetaError):
                pass  # the follower's view still answers everything else
    return view


async def gather_status(client: MetaClient, deadline_s: float | None = None) -> dict[str, Any]:
    """The meta leader's view, each meta node's own status (`meta_nodes`), refusals and drift,
    all within `deadline_s` when given (--timeout must not overshoot by the asks it makes)."""
    end = None if deadline_s is None else time.monotonic() + deadline_s
    view = await leader_view(client, deadline_s)
    nodes = view.get("meta", [])
    # The nodes are asked in parallel, each for at most NODE_STATUS_S and never past the end.
    # A floor keeps a node from reading as down only because the view took the whole budget.
    node_s = NODE_STATUS_S if end is None else max(0.05, min(NODE_STATUS_S, end - time.monotonic()))

    async def one(node: dict[str, str]) -> dict[str, Any]:
        try:
            st = await client.status(node["http"], timeout_s=node_s)
            # has_quorum and peers: the node's own Raft view (connected to a majority; to
            # whom), which the health verdict prefers over what this host can reach.
            peers = st.get("peers") if isinstance(st.get("peers"), dict) else {}
            return {"id": node["id"], "http": node["http"], "up": True, "role": st["role"], "leader": st["leader"],
                    "revision": st["revision"], "raft_term": st["raft_term"], "refusals": st.get("refusals", []),
                    "version": st.get("version"), "has_quorum": st.get("has_quorum"),
                    "peers": {pid: {"connected": p.get("connected")} for pid, p in peers.items()
                              if isinstance(p, dict)}}
        except (OSError, asyncio.TimeoutError, ValueError, KeyError) as exc:
            return {"id": node["id"], "http": node["http"], "up": False, "error": type(exc).__name__}
        except Exception as exc:  # noqa: BLE001 - aiohttp raises a family of errors; any means "down"
            return {"id": node["id"], "http": node["http"], "up": False, "error": type(exc).__name__}

    view["meta_nodes"] = list(await asyncio.gather(*(one(n) for n in nodes)))
    # Each node keeps the admission refusals it answered itself: show them all, oldest first.
    view["refusals"] = sorted(({**r, "meta": n["id"]} for n in view["meta_nodes"] for r in n.get("refusals", [])),
                              key=lambda r: r.get("at_unix_ms", 0))
    view["drift"] = [d.to_dict() for d in drift(view.get("topology"), view)]
    return view


def render_status(st: dict[str, Any], health: Health | None = None) -> str:
    """The human view; with `health`, it opens with the verdict and why, and
    shows every replica's lag after the groups."""
    lines = [*render_health(health), ""] if health is not None else []
    topo = st.get("topology") or {}
    lines.append(f"cluster {topo.get('cluster', '(no topology applied)')}  revision {st['revision']}  "
                 f"topology revision {st['topology_revision']}  meta leader {st.get('meta_leader') or '-'}")
    lines.append("")
    lines.append(f"{'META':<8} {'HTTP':<22} {'STATE':<10} {'REVISION':>8}")
    for n in st["meta_nodes"]:
        state = n["role"] if n["up"] else "DOWN"
        lines.append(f"{n['id']:<8} {n['http']:<22} {state:<10} {n.get('revision', '-'):>8}")
    lines.append("")
    rates = group_write_rates(st)
    holds = {gid: f"{m['name']} {g['first']}-{g['last']}" for gid, (m, g) in model_groups(topo).items()}
    lines.append(f"{'GROUP':<6} {'TERM':>5} {'LEADER':<10} {'READY':<6} {'PREFERRED':<10} {'VOTERS':<24} "
                 f"{'LEARNERS':<12} WRITES/S" + ("  MODEL LAYERS" if holds else ""))
    for gid, g in sorted(st["groups"].items(), key=lambda kv: int(kv[0])):
        # A '*' marks a group away from its preferred leader (leader balance moves it back).
        pref = g.get("preferred_leader") or "-"
        if g.get("preferred_leader") and g["preferred_leader"] != g["leader"]:
            pref += "*"
        rate = rates.get(str(gid))
        rate_s = "?" if rate is None else f"{rate:.0f}"
        lines.append(f"{gid:<6} {g['term']:>5} {g['leader'] or '-':<10} {'yes' if g['ready'] else 'no':<6} "
                     f"{pref:<10} {','.join(g['voters']):<24} {','.join(g['learners']) or '-':<12} "
                     + (f"{rate_s:<8}  {holds.get(int(gid), '-')}" if holds else rate_s))
    lines.append("")
    if health is not None and health.replicas:
        lines.extend(render_replicas(health))
        lines.append("")
    lines.append(f"{'WORKER':<8} {'ADDR':<22} {'ZONE':<8} {'STATE':<10} {'ADMISSION':<9} {'LIVE':<5} {'GROUPS':>6} "
                 f"{'LEADS':>5} {'WRITES/S':>8}  {'VERSION':<24} CAPACITY")
    for wid, w in sorted(st["workers"].items()):
        live = {True: "yes", False: "no"}.get(w.get("live"), "?")
        offered = [f"{what} {format_bytes(n)}" for what, n in (("ram", w.get("ram_bytes") or 0),
                                                                 ("disk", w.get("disk_bytes") or 0)) if n]
        hosted = sum(1 for g in st["groups"].values() if wid in (*g["voters"], *g["learners"]))
        leads = [str(gid) for gid, g in st["groups"].items() if g["leader"] == wid]
        led_rates = [rates.get(gid) for gid in leads]
        rate = "?" if any(r is None for r in led_rates) else f"{sum(r for r in led_rates if r is not None):.0f}"
        lines.append(f"{wid:<8} {w['addr']:<22} {w['zone']:<8} {w['state']:<10} {w.get('admission', 'admitted'):<9} "
                     f"{live:<5} {hosted:>6} {len(leads):>5} {rate:>8}  {software(w):<24} {', '.join(offered) or '-'}")
    lines.append("")
    if st.get("gateways"):
        lines.append(f"{'GATEWAY':<24} {'ADDR':<22} {'ADMISSION':<9} {'SEEN':>7}  VERSION")
        for g in st["gateways"]:
            seen = f"{g['last_seen_ms_ago'] / 1000:.0f}s ago"
            lines.append(f"{g['id']:<24} {g['addr']:<22} {g['admission']:<9} {seen:>7}  {software(g)}")
        lines.append("")
    if st.get("refusals"):
        lines.append("ADMISSION REFUSED (most recent last)")
        for r in st["refusals"]:
            by = f" (meta {r['meta']})" if r.get("meta") else ""
            claimed = " (claimed)" if r.get("claimed") else ""
            lines.append(f"  {r.get('principal') or '?'}{claimed} from {r.get('addr') or '?'}: {r['reason']}{by}")
        lines.append("")
    drifted = drift(st.get("topology"), st)
    if drifted:
        # The file pins these groups elsewhere: the controller chose availability
        # (repair, drain) or an operator moved them; applying the file moves them back.
        lines.append("DRIFT (groups whose live placement differs from the applied file)")
        lines.extend(f"  {render_drift(d)}" for d in drifted)
        lines.append("")
    return "\n".join(lines).rstrip("\n")


def render_replicas(h: Health) -> list[str]:
    """Every replica's progress: APPLY-LAG is its own commit minus applied (one report, no
    skew); BEHIND is its group's leader's last seq minus its commit ('?': no current
    report from that leader). Reports come every lease/5 from each worker, so under
    write load a replica in step reads a little behind."""
    out = [f"{'GROUP':<6} {'REPLICA':<10} {'ROLE':<8} {'STATE':<10} {'COMMIT':>10} {'APPLIED':>10} "
           f"{'APPLY-LAG':>9} {'BEHIND':>8}"]

    def n(v: int | None) -> str:
        return "?" if v is None else str(v)

    for r in h.replicas:
        out.append(f"{r.group:<6} {r.worker:<10} {r.role:<8} {r.state:<10} {n(r.commit):>10} {n(r.applied):>10} "
                   f"{n(r.apply_lag):>9} {n(r.behind):>8}")
    return out


def group_write_rates(st: dict[str, Any]) -> dict[str, float]:
    """Acknowledged writes/s per group, as its leader last reported them (only
    the meta leader's view carries reports; a group missing here is unknown)."""
    out: dict[str, float] = {}
    workers = st.get("workers") or {}
    for gid, g in st["groups"].items():
        rep = ((workers.get(g["leader"] or "") or {}).get("report") or {}).get("groups", {}).get(str(gid))
        if isinstance(rep, dict) and rep.get("role") == "leader" and isinstance(rep.get("write_rate"), (int, float)):
            out[str(gid)] = float(rep["write_rate"])
    return out


def status_doc(st: dict[str, Any], h: Health) -> dict[str, Any]:
    """`-o json|yaml`: the gathered status, with the verdict under `health`."""
    return {**st, "health": h.to_dict()}


async def cmd_status(args: argparse.Namespace) -> int:
    if getattr(args, "wait_for", None):
        return await wait_for_verdict(args, Verdict(args.wait_for))
    async with _client(args) as client:
        st = await gather_status(client, _meta_deadline(args))
    h = assess(st)
    _emit(args, status_doc(st, h), lambda: render_status(st, h).splitlines())
    return VERDICT_EXIT[h.verdict]


@dataclass(frozen=True)
class Clock:
    """Where `--wait-for` reads the time and sleeps: the system's, or a test's fake one."""

    now: Callable[[], float]
    sleep: Callable[[float], Awaitable[None]]


def system_clock() -> Clock:
    return Clock(time.monotonic, asyncio.sleep)


def confirm_s(st: dict[str, Any]) -> float:
    """How long a wanted verdict must hold before `--wait-for` believes it. A worker that
    died still counts as live at meta for one lease (and meta serves its last report, up to
    one report period, lease/5, old): a verdict seen over less than that may not have
    noticed it yet."""
    lease = lease_ms(st)
    return (lease + lease / 5) / 1000.0


async def wait_for_verdict(args: argparse.Namespace, wanted: Verdict, clock: Clock | None = None) -> int:
    """Poll until the verdict is `wanted` or better on consecutive answers spanning more
    than `confirm_s` (0), saying the verdict and why each time they change. At --timeout:
    4 if the last verdict was good enough but had not held that long yet, else the last
    verdict's exit code, or 3 if no try answered at all. Errors while asking meta are
    progress, not the end: meta fails over too, and the caller asked to wait."""
    clock = clock or system_clock()
    say = _progress(args)
    total = WAIT_FOR_DEFAULT_S if getattr(args, "timeout", None) is None else float(args.timeout)
    start = clock.now()
    deadline = start + total
    shown: object = None
    last: tuple[dict[str, Any], Health] | None = None  # the last answer, kept when a later try fails
    last_failed = False
    # When the answer that opened the current run of good-enough verdicts arrived (None: no run).
    held_since: float | None = None

    def stamp() -> str:
        return f"[{clock.now() - start:.0f}s]"

    while True:
        asked = clock.now()
        remaining = deadline - asked
        if remaining <= 0:
            return _wait_ended(args, wanted, total, last, last_failed)
        # Each round bounded by what is left, so the wait ends on time even with meta down.
        budget = min(META_DEADLINE_S, remaining)
        try:
            async with _client(args, deadline_s=budget) as client:
                st = await gather_status(client, budget)
        except (MetaUnreachable, MetaError) as exc:
            last_failed = True
            held_since = None  # a gap: the verdict may have changed unseen
            if shown != "unreachable":
                shown = "unreachable"
                say(f"{stamp()} meta did not answer: {exc}")
        else:
            answered = clock.now()
            h = assess(st)
            last, last_failed = (st, h), False
            if progress_key(h) != shown:
                shown = progress_key(h)
                for line in render_health(h):
                    say(f"{stamp()} {line}")
            window = confirm_s(st)
            if not h.verdict.at_least(wanted):
                held_since = None
            elif held_since is None:
                held_since = answered
                say(f"{stamp()} confirming: {h.verdict.value} must hold for {window:.1f} s (lease_ms and one "
                    "report period: meta counts a worker that just died as live until then)")
            elif asked - held_since > window:
                # `asked` (before this answer) minus `answered` (after the first): the views
                # are at least this far apart, whenever meta made them.
                held = asked - held_since
                _emit(args, status_doc(st, h), lambda: [f"{stamp()} {h.verdict.value} held for {held:.1f} s: done"])
                return 0
        await clock.sleep(max(0.0, min(WAIT_FOR_POLL_S, deadline - clock.now())))


def _wait_ended(args: argparse.Namespace, wanted: Verdict, total: float,
                last: tuple[dict[str, Any], Health] | None, last_failed: bool) -> int:
    """`--wait-for` at its timeout: the exit code, the last verdict on stderr, and with
    -o json|yaml the last status (or an error document) as stdout's one document."""
    if last is None:
        message = f"not {wanted.value} after {total:.0f} s: no meta node answered at {args.meta}"
        _err(f"topoctl: {message}")
        return _error_doc(args, EXIT_UNREACHABLE, "meta_unreachable", message)
    st, h = last
    if _format(args) != "table":
        _out(dump(status_doc(st, h), _format(args)))
    tail = " (meta did not answer the last try)" if last_failed else ""
    if h.verdict.at_least(wanted):
        _err(f"topoctl: {h.verdict.value} after {total:.0f} s, but it had not held for {confirm_s(st):.1f} s "
             f"yet{tail}")
        return EXIT_NOT_CONVERGED
    _err(f"topoctl: not {wanted.value} after {total:.0f} s; last verdict {h.verdict.value}{tail}:")
    for line in render_health(h)[1:]:
        _err(line)
    return VERDICT_EXIT[h.verdict]


async def cmd_get(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        text, revision = await client.get_topology()
    if _format(args) == "json":
        # The file as applied, as data (table and yaml print its text, comments included).
        _out(dump({"topology_revision": revision, "topology": yaml.safe_load(text)}, "json"))
    else:
        sys.stdout.write(text)
    return 0


# -- operator verbs --------------------------------------------------------------------

async def cmd_transfer(args: argparse.Namespace) -> int:
    body = {"to": args.to} if args.to else {}
    async with _client(args) as client:
        res = await client.call("POST", f"/v1/groups/{args.shard}/transfer", json=body, admin=True,
                                deadline_s=max(_meta_deadline(args), 15.0), attempt_timeout_s=14.0)

    def table() -> list[str]:
        if not res.get("changed", True):
            return [f"group {args.shard}: {res['leader']} already leads (term {res['term']})"]
        return [f"group {args.shard}: leader {res['old_leader']} (term {res['old_term']}) -> "
                f"{res['new_leader']} (term {res['new_term']})"]

    _emit(args, res, table)
    return 0


async def cmd_replicas(args: argparse.Namespace) -> int:
    body = {"add": args.add} if args.add else {"remove": args.remove}
    say = _progress(args)
    async with _client(args) as client:
        op = await client.call("POST", f"/v1/groups/{args.shard}/replicas", json=body, admin=True)
        started = f"group {args.shard}: {op['kind']} {op['worker']} started (step {op['step']})"
        if args.no_wait:
            _emit(args, {"operator": op, "done": False}, lambda: [started])
            return 0
        say(started)
        last = None
        deadline = asyncio.get_running_loop().time() + args.wait
        while True:
            ops = (await client.call("GET", "/v1/operators"))["operators"]
            cur = ops.get(str(args.shard))
            if cur is None or (cur["kind"], cur["worker"]) != (op["kind"], op["worker"]):
                view = await client.cluster()
                g = view["groups"][str(args.shard)]
                _emit(args, {"operator": op, "done": True, "group": g},
                      lambda: [f"group {args.shard}: done. voters {','.join(g['voters'])}; "
                               f"learners {','.join(g['learners']) or '-'}"])
                return 0
            line = f"  {cur['step']}: {cur['message']}"
            if line != last:
                say(line)
                last = line
            if asyncio.get_running_loop().time() > deadline:
                message = f"still in progress after {args.wait:.0f} s (see topoctl operators); not cancelled"
                _err(f"topoctl: {message}")
                return _error_doc(args, EXIT_REJECTED, "not_done", message, operator=cur)
            await asyncio.sleep(0.5)


async def _worker_verb(args: argparse.Namespace, verb: str, after: str) -> int:
    """POST /v1/workers/W/VERB (admin) and say the worker's new state."""
    async with _client(args) as client:
        res = await client.call("POST", f"/v1/workers/{args.worker}/{verb}", json={}, admin=True)
    _emit(args, res, lambda: [f"{res['worker']}: {res['state']}{after}"])
    return 0


async def cmd_worker(args: argparse.Namespace) -> int:
    """`topoctl worker gone|revoke|admit W`."""
    if args.action == "gone":  # W will not come back; replace its replicas now
        return await _worker_verb(args, "gone", "; its replicas are replaced now (topoctl operators shows the moves)")
    async with _client(args) as client:
        res = await client.call("POST", f"/v1/workers/{args.worker}/{args.action}", json={}, admin=True)
    tail = {"revoke": ": meta and its peers refuse it; its leaderships fail over and its replicas are replaced "
                      "(topoctl status, topoctl operators)",
            "admit": ": it may register again and be placed (it keeps nothing it hosted before)"}[args.action]
    _emit(args, res, lambda: [f"{res['worker']}: {res['admission']}{'' if res.get('changed', True) else ' already'}"
                              f"{tail}"])
    return 0


async def cmd_drain(args: argparse.Namespace) -> int:
    """`topoctl drain W`: hand W's leaderships over, replace its replicas, then `drained`."""
    say = _progress(args)
    async with _client(args) as client:
        res = await client.call("POST", f"/v1/workers/{args.worker}/drain", json={}, admin=True)
        started = f"{args.worker}: {res['state']}" + ("" if res.get("changed", True) else " already")
        if args.no_wait:
            _emit(args, res, lambda: [started])
            return 0
        say(started)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + args.wait
        shown = ""
        ops_shown: dict[str, str] = {}
        while True:
            view = await client.cluster()
            w = view["workers"].get(args.worker, {})
            if w.get("state") == "drained":
                _emit(args, {**res, "state": "drained"},
                      lambda: [f"{args.worker}: drained (hosts no replica; `topoctl undrain {args.worker}` makes it "
                               "eligible again)"])
                return 0
            if w.get("state") != "draining":
                message = f"{args.worker} is {w.get('state')} now, not draining (undrained meanwhile?)"
                _err(f"topoctl: {message}")
                return _error_doc(args, EXIT_REJECTED, "not_draining", message, state=w.get("state"))
            leads = sorted(int(g) for g, rec in view["groups"].items() if rec["leader"] == args.worker)
            hosts = sorted(int(g) for g, rec in view["groups"].items()
                           if args.worker in (*rec["voters"], *rec["learners"]))
            line = (f"  leads groups {','.join(map(str, leads)) or '-'}; hosts groups "
                    f"{','.join(map(str, hosts)) or '-'}")
            if line != shown:
                say(line)
                shown = line
            # One line per group whenever its operator's step or message changes (snapshot bytes too).
            ops = {str(g): operator_text(op) for g, op in (view.get("operators") or {}).items()}
            for g in sorted(ops, key=int):
                if ops_shown.get(g) != ops[g]:
                    say(f"  group {g}: {ops[g]}")
            ops_shown = ops
            if loop.time() > deadline:
                message = f"{args.worker} still draining after {args.wait:.0f} s (it goes on; topoctl operators)"
                _err(f"topoctl: {message}")
                return _error_doc(args, EXIT_NOT_CONVERGED, "not_drained", message, leads=leads, hosts=hosts)
            await asyncio.sleep(POLL_S)


async def cmd_undrain(args: argparse.Namespace) -> int:
    return await _worker_verb(args, "undrain", " (eligible for replicas and leaderships again)")


async def cmd_operators(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        ops = (await client.call("GET", "/v1/operators"))["operators"]

    def table() -> list[str]:
        if not ops:
            return ["no operators in progress"]
        return [f"{'GROUP':<6} {'KIND':<7} {'WORKER':<8} {'STEP':<12} MESSAGE"] + [
            f"{gid:<6} {op['kind']:<7} {op['worker']:<8} {op['step']:<12} {op['message']}"
            for gid, op in sorted(ops.items(), key=lambda kv: int(kv[0]))]

    _emit(args, ops, table)
    return 0


async def cmd_completion(args: argparse.Namespace) -> int:
    sys.stdout.write(bash_completion(build_parser()))
    return 0


# -- main ----------------------------------------------------------------------------

class _Version(argparse.Action):
    """--version: the package version and the code digest (as workers report theirs),
    computed only when asked (the digest reads every source file)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print topoctl's version (package version and code digest) and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        _out(f"topoctl {package_version()} (code {code_digest()[:8]})")
        parser.exit(0)


def _global_options(p: argparse.ArgumentParser, defaults: bool) -> None:
    """The options every verb takes, before or after it. On the verbs' side they
    default to SUPPRESS: argparse copies a subparser's defaults over what was
    parsed before the verb, so `--meta X status` would otherwise lose X."""
    def d(value: Any) -> Any:
        return value if defaults else argparse.SUPPRESS

    p.add_argument("--meta", default=d(os.environ.get("SHARDGRID_META", DEFAULT_META)),
                   help="meta HTTP addresses, comma-separated (env SHARDGRID_META)")
    p.add_argument("--timeout", type=float, default=d(None), metavar="S",
                   help=f"seconds to keep trying the meta nodes before giving up (default {META_DEADLINE_S:.0f}); "
                        f"with `status --wait-for`, how long to wait for the verdict (default "
                        f"{WAIT_FOR_DEFAULT_S:.0f})")
    p.add_argument("--admin-token-file", default=d(None),
                   help="file holding the admin token (else env SHARDGRID_ADMIN_TOKEN)")
    p.add_argument("--tls-ca", default=d(os.environ.get(CA_ENV) or None), metavar="PEM",
                   help=f"talk to meta over https, verified against this CA (env {CA_ENV})")
    p.add_argument("-o", "--output", choices=OUTPUTS, default=d("table"),
                   help="table (default), json or yaml: json and yaml print one document on stdout, "
                        "progress on stderr")
    p.add_argument("--json", dest="output", action="store_const", const="json", default=argparse.SUPPRESS,
                   help="same as -o json")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="topoctl", description="Operate a shardgrid cluster.",
                                epilog="Exit codes: 0 ok (status: green), 1 rejected, 2 usage, 3 no meta node "
                                       "answered, 4 not converged when the wait ended, 5 status yellow, "
                                       "6 status red.")
    _global_options(p, defaults=True)
    p.add_argument("--version", action=_Version)
    common = argparse.ArgumentParser(add_help=False)
    _global_options(common, defaults=False)
    sub = p.add_subparsers(dest="command", required=True, metavar="VERB")

    def verb(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, parents=[common])

    a = verb("apply", "validate a topology file, print the plan, apply it")
    a.add_argument("file")
    a.add_argument("--dry-run", action="store_true",
                   help="print the plan and the live cluster's drift from the file, and stop")
    a.add_argument("--no-wait", action="store_true", help="return once applied, without following the moves")
    a.add_argument("--wait", type=float, default=600.0,
                   help=f"seconds to follow the moves until converged (default 600); exit {EXIT_NOT_CONVERGED} "
                        "when they have not finished by then")
    a.set_defaults(func=cmd_apply)
    s = verb("status", "the verdict (green, yellow, red) and why; meta nodes, groups, replicas, workers")
    s.add_argument("--wait-for", choices=("green", "yellow"), default=None,
                   help="poll until the verdict is this good or better and has held over lease_ms plus one report "
                        "period (exit 0), printing it and why when they change; --timeout bounds the wait (default "
                        f"{WAIT_FOR_DEFAULT_S:.0f} s), after which the exit code is the last verdict's "
                        f"({EXIT_NOT_CONVERGED} if reached but not held long enough; {EXIT_UNREACHABLE} if meta never "
                        "answered)")
    s.set_defaults(func=cmd_status)
    g = verb("get", "print the applied topology YAML (-o json: as data)")
    g.set_defaults(func=cmd_get)
    t = verb("transfer", "move a group's leadership to another voter")
    t.add_argument("shard", type=int)
    t.add_argument("--to", default=None, help="target worker (default: the best caught-up voter)")
    t.set_defaults(func=cmd_transfer)
    r = verb("replicas", "add or remove a replica of a group (staged)")
    r.add_argument("shard", type=int)
    grp = r.add_mutually_exclusive_group(required=True)
    grp.add_argument("--add", metavar="WORKER")
    grp.add_argument("--remove", metavar="WORKER")
    r.add_argument("--no-wait", action="store_true", help="start it and return")
    r.add_argument("--wait", type=float, default=300.0, help="seconds to follow progress (default 300)")
    r.set_defaults(func=cmd_replicas)
    o = verb("operators", "placement changes in progress")
    o.set_defaults(func=cmd_operators)
    d = verb("drain", "take a worker out of service: leaderships, then replicas, move elsewhere")
    d.add_argument("worker")
    d.add_argument("--no-wait", action="store_true", help="start it and return")
    d.add_argument("--wait", type=float, default=600.0,
                   help=f"seconds to follow it until drained (default 600; exit {EXIT_NOT_CONVERGED} after)")
    d.set_defaults(func=cmd_drain)
    u = verb("undrain", "make a drained worker eligible for replicas and leaderships again")
    u.add_argument("worker")
    u.set_defaults(func=cmd_undrain)
    w = verb("worker", "worker verbs: gone W (it will not come back: replace its replicas now), "
                       "revoke W (take its credentials away), admit W (undo a revoke)")
    w.add_argument("action", choices=["gone", "revoke", "admit"])
    w.add_argument("worker")
    w.set_defaults(func=cmd_worker)
    c = verb("completion", "print a shell completion script: `source <(topoctl completion bash)`")
    c.add_argument("shell", choices=["bash"])
    c.set_defaults(func=cmd_completion)
    return p


def _verbs(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in p._actions:  # argparse offers no public way to list a parser's subparsers
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(p: argparse.ArgumentParser) -> tuple[list[str], dict[str, list[str]]]:
    """A parser's option strings, and the values of those that take a fixed set."""
    opts: list[str] = []
    values: dict[str, list[str]] = {}
    for action in p._actions:
        opts.extend(o for o in action.option_strings)
        if action.option_strings and action.choices is not None:
            for o in action.option_strings:
                values[o] = [str(c) for c in action.choices]
    return opts, values


def bash_completion(p: argparse.ArgumentParser) -> str:
    """A bash completion script for `p`, generated from it (so it never lists a verb
    or option the parser does not take): verbs, each verb's options and global
    options, the values of choice options and positionals; files otherwise."""
    verbs = _verbs(p)
    top_opts, values = _options(p)
    cases = []
    for name, vp in verbs.items():
        opts, vals = _options(vp)
        values.update(vals)
        positional = [str(c) for a in vp._actions if not a.option_strings and a.choices for c in a.choices]
        words = " ".join(dict.fromkeys([*positional, *opts]))
        cases.append(f"        {name}) words=\"{words}\" ;;")
    value_cases = [f"        {opt}) COMPREPLY=($(compgen -W \"{' '.join(vals)}\" -- \"$cur\")); return ;;"
                   for opt, vals in sorted(values.items())]
    return "\n".join([
        "# bash completion for topoctl, generated by `topoctl completion bash`",
        "_topoctl() {",
        "    local cur prev verb words i",
        "    cur=\"${COMP_WORDS[COMP_CWORD]}\"",
        "    prev=\"${COMP_WORDS[COMP_CWORD-1]}\"",
        "    case \"$prev\" in",
        *value_cases,
        "    esac",
        "    verb=\"\"",
        "    for ((i = 1; i < COMP_CWORD; i++)); do",
        "        case \"${COMP_WORDS[i]}\" in",
        f"            {'|'.join(verbs)}) verb=\"${{COMP_WORDS[i]}}\"; break ;;",
        "        esac",
        "    done",
        "    case \"$verb\" in",
        f"        \"\") words=\"{' '.join([*verbs, *top_opts])}\" ;;",
        *cases,
        "    esac",
        "    COMPREPLY=($(compgen -W \"$words\" -- \"$cur\"))",
        "}",
        "complete -o default -F _topoctl topoctl",
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(asyncio.run(args.func(args)))
    # A verb prints its document only once it has its answer, so none was printed before these.
    except MetaUnreachable as exc:
        _err(f"topoctl: no meta node answered at {args.meta}: {exc}")
        if args.tls_ca is None and "ServerDisconnected" in str(exc):
            # What plain http to an HTTPS listener looks like from here.
            _err(f"topoctl: if the cluster serves HTTPS, pass --tls-ca PEM (or {CA_ENV})")
        return _error_doc(args, EXIT_UNREACHABLE, "meta_unreachable", f"no meta node answered at {args.meta}: {exc}")
    except (SecretFileError, TlsConfigError) as exc:
        _err(f"topoctl: {exc}")
        return _error_doc(args, EXIT_REJECTED, "config", str(exc))
    except MetaError as exc:
        _err(f"topoctl: {exc.code}: {exc.message}")
        errors = exc.body.get("errors", []) if isinstance(exc.body, dict) else []
        for e in errors:
            _err(f"  {e.get('path') or '<root>'}: {e.get('message')}")
        return _error_doc(args, EXIT_REJECTED, exc.code, exc.message, status=exc.status,
                          **({"errors": errors} if errors else {}))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
