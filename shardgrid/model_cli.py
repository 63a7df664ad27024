"""`shardgrid model run`: a layer-sharded model computed in one process, without a cluster.

The reference a cluster's `POST /v1/models/{name}/infer` must equal, byte
for byte in float32, whatever route its hops took: the same topology file,
the same input file (`{"input": [[...], ...]}`, as the gateway takes it),
the weights of a given seed (default: the model's, i.e. version 1).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="model_command", required=True)
    r = sub.add_parser("run", help="compute a model's output in this process (the cluster's reference)")
    r.add_argument("--topology", required=True, help="topology file declaring the model")
    r.add_argument("--model", required=True, help="the model's name")
    r.add_argument("--input", required=True, help='JSON file {"input": [[d_model numbers], ...]} ("-": stdin)')
    r.add_argument("--seed", type=int, default=None, help="weights from this seed (default: the model's own)")
    r.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    from topology.errors import TopologyError
    from topology.loader import load_topology

    try:
        topo = load_topology(Path(args.topology).read_bytes())
    except (OSError, TopologyError) as exc:
        sys.stderr.write(f"shardgrid model run: {args.topology}: {exc}\n")
        return 2
    spec = topo.model(args.model)
    if spec is None:
        known = ", ".join(m.name for m in topo.models) or "none"
        sys.stderr.write(f"shardgrid model run: no model {args.model!r} in {args.topology} (models: {known})\n")
        return 2
    try:
        raw = sys.stdin.buffer.read() if args.input == "-" else Path(args.input).read_bytes()
        body = orjson.loads(raw)
    except (OSError, orjson.JSONDecodeError) as exc:
        sys.stderr.write(f"shardgrid model run: {args.input}: {exc}\n")
        return 2
    rows = body.get("input") if isinstance(body, dict) else None
    from worker.plugins.layers_model import ModelConfig, rows_to_tensor, run_model

    cfg = ModelConfig.from_dict(spec.to_dict())
    try:
        x = rows_to_tensor(rows, cfg.d_model)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        sys.stderr.write(f"shardgrid model run: {args.input}: {exc}\n")
        return 2
    y = run_model(cfg, x, seed=args.seed)
    sys.stdout.buffer.write(orjson.dumps({"model": spec.name, "output": y.tolist()}) + b"\n")
    return 0
