"""The JSON lines every server process logs."""
from __future__ import annotations

import json
from typing import Any

import structlog

from shardgrid.common.log import render_json


def _render(event: dict[str, Any]) -> dict[str, Any]:
    line = structlog.processors.JSONRenderer(serializer=render_json)(None, "info", dict(event))
    assert isinstance(line, str) and "\n" not in line
    parsed: dict[str, Any] = json.loads(line)
    return parsed


def test_a_line_is_the_event_as_json_in_order() -> None:
    event = {"event": "access", "route": "/items/{id}", "status": 200, "ms": 17.272, "shard": None,
             "voters": ("w1", "w2"), "rid": "é-1"}
    line = structlog.processors.JSONRenderer(serializer=render_json)(None, "info", dict(event))
    assert list(json.loads(line)) == list(event)
    assert _render(event) == {**event, "voters": ["w1", "w2"]}


def test_what_json_cannot_hold_still_makes_a_line() -> None:
    class Opaque:
        def __repr__(self) -> str:
            return "<opaque>"

    # Integer dict keys (group ids), an object, and an int beyond 64 bits
    # (which orjson refuses: the stdlib fallback writes it).
    out = _render({"event": "x", "groups": {1: "leader"}, "thing": Opaque(), "big": 2 ** 70})
    assert out == {"event": "x", "groups": {"1": "leader"}, "thing": "<opaque>", "big": 2 ** 70}
    assert _render({"event": "x", "thing": Opaque()}) == {"event": "x", "thing": "<opaque>"}
