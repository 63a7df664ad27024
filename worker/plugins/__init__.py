"""Pluggable shard-group state machines; the contract is in base.py."""
from worker.plugins.base import (
    ApplyContext,
    BadOp,
    NotFound,
    Plugin,
    PluginError,
    PluginSettings,
    SnapshotError,
    Unappliable,
    available_plugins,
    load_plugin,
)

__all__ = [
    "ApplyContext",
    "BadOp",
    "NotFound",
    "Plugin",
    "PluginError",
    "PluginSettings",
    "SnapshotError",
    "Unappliable",
    "available_plugins",
    "load_plugin",
]
