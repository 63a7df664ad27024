"""The shared vocabulary of shardgrid: topology model, file loading and
validation, entity routing, automatic placement and apply plans.
"""
from topology.errors import FieldError, TopologyError
from topology.loader import load_topology
from topology.model import GroupSpec, MetaNode, Settings, Topology, WorkerSpec
from topology.placement import place_groups
from topology.plan import Action, AddReplica, CreateGroup, MoveLeader, RemoveReplica, plan, render_plan
from topology.routing import fnv1a64, shard_for

__all__ = [
    "Action",
    "AddReplica",
    "CreateGroup",
    "FieldError",
    "GroupSpec",
    "MetaNode",
    "MoveLeader",
    "RemoveReplica",
    "Settings",
    "Topology",
    "TopologyError",
    "WorkerSpec",
    "fnv1a64",
    "load_topology",
    "place_groups",
    "plan",
    "render_plan",
    "shard_for",
]
