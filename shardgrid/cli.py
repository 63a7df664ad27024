"""`shardgrid ...`: the server processes and the local dev cluster."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING
import sys
from pathlib import Path

from shardgrid.common.auth import SecretFileError, read_secret
from shardgrid.common.tls import TlsConfigError, add_tls_arguments, tls_from_args

if TYPE_CHECKING:
    from shardgrid.common.peerauth import ClusterKeys

_SECRET_HELP = "cluster secret, the meta nodes' file (else env SHARDGRID_SECRET); one secret per line during a rotation"


# A secret is a key to an HMAC: short ones fall to an offline guess from one
# captured hello. `openssl rand -hex 32` gives 64 characters.
MIN_SECRET_CHARS = 16


def _cluster_keys(args: argparse.Namespace, who: str) -> "ClusterKeys | None":
    """The cluster secret a member proves itself with; None (and a message) when there is none."""
    from shardgrid.common.peerauth import ClusterKeys

    text = read_secret(args.secret_file, "SHARDGRID_SECRET")
    if text is None:
        sys.stderr.write(f"shardgrid {who}: the cluster secret is required (--secret-file or SHARDGRID_SECRET, "
                         "the same one the meta nodes have): every request between cluster members is "
                         "authenticated with it\n")
        return None
    keys = ClusterKeys.from_text(text)
    if keys.shortest < MIN_SECRET_CHARS:
        sys.stderr.write(f"shardgrid {who}: a cluster secret must have at least {MIN_SECRET_CHARS} characters "
                         "(make one with `openssl rand -hex 32`)\n")
        return None
    return keys


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _cmd_meta(args: argparse.Namespace) -> int:
    from meta.process import MetaProcessConfig, main as meta_main, parse_peers
    from meta.raft import RaftPeer

    keys = _cluster_keys(args, "meta")
    if keys is None:
        return 2
    # PySyncObj's password: its wire format is pickle, so whoever holds the
    # password and reaches the raft port runs code on meta. Workers and
    # gateways hold the cluster secret; the raft password should be meta's alone.
    raft_password = read_secret(args.raft_secret_file, "SHARDGRID_RAFT_SECRET")
    if raft_password is not None and len(raft_password) < MIN_SECRET_CHARS:
        sys.stderr.write(f"shardgrid meta: the raft secret must have at least {MIN_SECRET_CHARS} characters\n")
        return 2
    try:
        peers = parse_peers(args.peers)
    except ValueError as exc:
        sys.stderr.write(f"shardgrid meta: --peers: {exc}\n")
        return 2
    cfg = MetaProcessConfig(
        me=RaftPeer(args.id, args.raft, args.http),
        peers=peers,
        data_dir=Path(args.data),
        password=read_secret(args.secret_file, "SHARDGRID_SECRET") or "",
        raft_password=raft_password,
        admin_token=read_secret(args.admin_token_file, "SHARDGRID_ADMIN_TOKEN"),
        tls=tls_from_args(args),
    )
    return meta_main(cfg)


def _cmd_worker(args: argparse.Namespace) -> int:
    from shardgrid.common.units import parse_bytes
    from worker.process import WorkerConfig, main as worker_main

    try:
        ram = parse_bytes(args.available_ram) if args.available_ram else 0
        disk = parse_bytes(args.available_disk) if args.available_disk else 0
    except ValueError as exc:
        sys.stderr.write(f"shardgrid worker: {exc}\n")
        return 2
    keys = _cluster_keys(args, "worker")
    if keys is None:
        return 2
    from shardgrid.common.identity import current

    cfg = WorkerConfig(id=args.id, listen=args.http, advertise=args.advertise or args.http,
                       meta=[a.strip() for a in args.meta.split(",") if a.strip()], data=Path(args.data),
                       zone=args.zone, source_addr=args.source_addr, available_ram=ram, available_disk=disk,
                       cluster_keys=keys, identity=current(), tls=tls_from_args(args),
                       infer_max_rows=args.infer_max_rows, infer_max_wait_ms=args.infer_max_wait_ms)
    return worker_main(cfg)


def _cmd_gateway(args: argparse.Namespace) -> int:
    from gateway.process import GatewayConfig, main as gateway_main

    meta = tuple(a.strip() for a in args.meta.split(",") if a.strip())
    if not meta:
        sys.stderr.write("shardgrid gateway: --meta needs at least one address\n")
        return 2
    keys = _cluster_keys(args, "gateway")
    if keys is None:
        return 2
    import socket

    from shardgrid.common.identity import current
    from shardgrid.common.peerauth import PeerAuthError, parse_principal

    # Not the listen address: `0.0.0.0:8080` on two hosts would be one name.
    gateway_id = args.id or f"{socket.gethostname()}-{args.http.rpartition(':')[2]}"
    try:
        parse_principal(f"gateway:{gateway_id}")
    except PeerAuthError:
        sys.stderr.write(f"shardgrid gateway: --id {gateway_id!r}: use letters, digits and - _ . : "
                         "(at most 128 characters)\n")
        return 2

    cfg = GatewayConfig(listen=args.http, meta=meta,
                        admin_token=read_secret(args.admin_token_file, "SHARDGRID_ADMIN_TOKEN"),
                        access_log=args.access_log, id=gateway_id, cluster_keys=keys,
                        identity=current(), tls=tls_from_args(args))
    return gateway_main(cfg)


def _cmd_dev(args: argparse.Namespace) -> int:
    if args.action != "run":
        from shardgrid.devcontrol import run_client

        return run_client(Path(args.data), args.action, args.name, args.signal, args.available_ram,
                          args.available_disk, wait_live=not args.no_wait)
    if args.name is not None:
        sys.stderr.write(f"shardgrid dev: unexpected argument {args.name!r}\n")
        return 2
    from shardgrid.devcluster import DevOptions, run_dev

    return run_dev(DevOptions(data=Path(args.data), fresh=args.fresh, topology=Path(args.topology),
                              workers=args.workers, shards=args.shards, gateways=args.gateways,
                              gateway_port=args.gateway_port, tls=args.tls))


def _cmd_bench(args: argparse.Namespace) -> int:
    from shardgrid.bench.run import main_from_args

    return main_from_args(args, sys.argv[2:] if sys.argv[1:2] == ["bench"] else None)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardgrid", description="shardgrid: sharded, quorum-replicated data service")
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("meta", help="run one metadata-service node")
    m.add_argument("--id", required=True)
    m.add_argument("--raft", required=True, help="host:port of this node's Raft transport")
    m.add_argument("--http", required=True, help="host:port of this node's HTTP API")
    m.add_argument("--peers", default="", help="the other nodes: ID/RAFT/HTTP,ID/RAFT/HTTP")
    m.add_argument("--data", required=True, help="directory for the Raft journal and dump")
    m.add_argument("--secret-file", default=None, help=_SECRET_HELP)
    m.add_argument("--raft-secret-file", default=None,
                   help="PySyncObj's password, the meta nodes' alone (else env SHARDGRID_RAFT_SECRET; without it, "
                        "the first line of the cluster secret, which workers and gateways hold too)")
    m.add_argument("--admin-token-file", default=None, help="admin token (else env SHARDGRID_ADMIN_TOKEN)")
    add_tls_arguments(m)
    m.set_defaults(func=_cmd_meta)

    w = sub.add_parser("worker", help="run one worker (hosts shard-group replicas)")
    w.add_argument("--id", required=True)
    w.add_argument("--http", required=True, help="host:port to listen on")
    w.add_argument("--advertise", default=None, help="host:port peers dial (default: --http)")
    w.add_argument("--meta", required=True, help="meta HTTP addresses, comma-separated")
    w.add_argument("--data", required=True, help="directory for group WALs and snapshots")
    w.add_argument("--zone", default=None, help="failure domain (default: the topology's)")
    w.add_argument("--secret-file", default=None, help=_SECRET_HELP)
    w.add_argument("--source-addr", default=None,
                   help="local IP for outgoing connections to peers and meta (multi-homed hosts, tests)")
    w.add_argument("--available-ram", default=None, metavar="SIZE",
                   help="memory this worker offers the cluster (e.g. 8GB); advertised to meta at registration")
    w.add_argument("--available-disk", default=None, metavar="SIZE",
                   help="disk this worker offers the cluster (e.g. 50GB); advertised to meta at registration")
    add_tls_arguments(w)
    w.add_argument("--infer-max-rows", type=_positive_int, default=64,
                   help="rows a model group's forward pass batches at most (1: no batching; default 64)")
    w.add_argument("--infer-max-wait-ms", type=float, default=2.0,
                   help="the longest a request waits for others to batch with (default 2 ms; never past "
                        "what its budget allows)")
    w.set_defaults(func=_cmd_worker)

    g = sub.add_parser("gateway", help="run one stateless gateway (the public API)")
    g.add_argument("--http", required=True, help="host:port to listen on")
    g.add_argument("--meta", required=True, help="meta HTTP addresses, comma-separated")
    g.add_argument("--id", default=None, help="its name in the cluster (default: HOSTNAME-PORT)")
    g.add_argument("--secret-file", default=None, help=_SECRET_HELP)
    g.add_argument("--admin-token-file", default=None,
                   help="admin token for /cluster/* (else env SHARDGRID_ADMIN_TOKEN; none = not checked here)")
    g.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=False,
                   help="one structured info line per request (default off: it costs CPU on every request)")
    add_tls_arguments(g)
    g.set_defaults(func=_cmd_gateway)

    from shardgrid.devcluster import DEFAULT_DATA, default_topology_path

    d = sub.add_parser("dev", help="run a local cluster as child processes on loopback",
                       description="Without an action: run the cluster (Ctrl-C stops it). From a second shell: "
                                   "`ps` lists its children, `kill NAME [--signal SIG]` signals one (KILL by "
                                   "default), `start NAME` restarts one with its data, `add-worker` starts a "
                                   "worker the topology does not declare.")
    d.add_argument("action", nargs="?", default="run", choices=["run", "ps", "kill", "start", "add-worker"],
                   help="run (default), or act on the cluster running with --data")
    d.add_argument("name", nargs="?", default=None, help="the child for kill and start (w1, m2, g1, ...)")
    d.add_argument("--signal", default="KILL", help="kill: KILL (default), TERM, STOP, CONT or INT")
    d.add_argument("--available-ram", default=None, metavar="SIZE", help="add-worker: memory it advertises (8GB)")
    d.add_argument("--available-disk", default=None, metavar="SIZE", help="add-worker: disk it advertises (50GB)")
    d.add_argument("--no-wait", action="store_true",
                   help="add-worker: return once started, without waiting for meta's leader to hear it")
    d.add_argument("--data", default=DEFAULT_DATA, help=f"data directory (default {DEFAULT_DATA})")
    d.add_argument("--fresh", action="store_true", help="wipe the data directory first")
    d.add_argument("--topology", default=str(default_topology_path()), help="topology file to apply")
    d.add_argument("--workers", type=int, default=None, help="generate a topology with N workers")
    d.add_argument("--shards", type=int, default=None, help="generate a topology with S shards")
    d.add_argument("--gateways", type=int, default=1, help="gateways to start (ports 8080, 8081, ...)")
    d.add_argument("--gateway-port", type=int, default=8080, help="port of the first gateway (default 8080)")
    d.add_argument("--tls", action="store_true",
                   help="HTTPS on every listener, with a CA and certificate made for this run under DATA/tls")
    d.set_defaults(func=_cmd_dev)

    from shardgrid.model_cli import add_model_arguments

    mo = sub.add_parser("model", help="layer-sharded models: compute one in this process (`model run`)")
    add_model_arguments(mo)

    from shardgrid.bench.run import add_bench_arguments

    b = sub.add_parser("bench", help="load generator and benchmark (closed/open loop; local cluster or etcd)",
                       description="Drive a shardgrid cluster (or etcd, for comparison) and report ops/s, errors, "
                                   "latency percentiles and cluster CPU per acknowledged write. "
                                   "See runbook/benchmarking.md.")
    add_bench_arguments(b)
    b.set_defaults(func=_cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (SecretFileError, TlsConfigError) as exc:
        # A configuration error with its fix in the message, not a traceback.
        sys.stderr.write(f"shardgrid {args.command}: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
