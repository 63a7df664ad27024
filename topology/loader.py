"""Topology file text -> validated `Topology`.

Parsing is PyYAML's safe loader with one addition: a key repeated in one
mapping is an error (plain `yaml.safe_load` silently keeps the last one, so
a second `shards:` further down a long file would win unnoticed). Keys merged
in with `<<:` may still be overridden, as YAML intends.
"""
from __future__ import annotations

from typing import Any

import yaml
from yaml.constructor import ConstructorError

from topology.errors import FieldError, TopologyError
from topology.model import Topology
from topology.validate import build_topology

_MERGE_TAG = "tag:yaml.org,2002:merge"


class _StrictSafeLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (a subclass: PyYAML's globals stay untouched)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _value in node.value:
                if key_node.tag == _MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    duplicate = key in seen
                except TypeError:
                    continue  # unhashable: the base class reports it with its mark
                if duplicate:
                    raise ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"found duplicate key {key!r}", key_node.start_mark,
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _parse(text: str) -> object:
    try:
        return yaml.load(text, Loader=_StrictSafeLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = e.problem or e.context or "malformed document"
        raise TopologyError([FieldError("", f"invalid YAML{where}: {problem}")]) from None
    except yaml.YAMLError as e:
        # Reader errors (e.g. control characters) carry a position, not a mark.
        raise TopologyError([FieldError("", f"invalid YAML: {e}")]) from None
    except RecursionError:
        # PyYAML composes and constructs recursively: a document nested
        # about a thousand levels deep (`[[[[...`) exhausts the stack. No
        # topology is nested more than a few levels; this is an input error.
        raise TopologyError([FieldError("", "invalid YAML: nested too deeply")]) from None


def load_topology(text: str | bytes, *, live: Topology | None = None) -> Topology:
    """Parse and validate a topology file.

    `live` is the topology the cluster runs now, if any: changes that an apply
    cannot perform (e.g. the number of shards) are then rejected.
    Raises TopologyError with every problem found; never returns partial data.
    """
    if isinstance(text, (bytes, bytearray, memoryview)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            before = bytes(text)[: e.start]
            line, column = before.count(b"\n") + 1, e.start - (before.rfind(b"\n") + 1) + 1
            raise TopologyError([FieldError(
                "", f"the file is not valid UTF-8: byte 0x{e.object[e.start]:02x} at line {line}, column {column}"
            )]) from None
    elif not isinstance(text, str):
        raise TypeError(f"load_topology takes str or bytes, not {type(text).__name__}")
    return build_topology(_parse(text), live=live)
