"""The JSON lines every server process logs."""
from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import structlog

from shardgrid.common.log import render_json, setup_logging


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


@pytest.fixture
def configured() -> Iterator[io.StringIO]:
    """Logging configured as a worker process configures it, into a buffer; undone after."""
    root = logging.getLogger()
    saved_level, saved_handlers = root.level, list(root.handlers)
    out = io.StringIO()
    try:
        yield out
    finally:
        for handler in [h for h in root.handlers if h not in saved_handlers]:
            root.removeHandler(handler)
        root.setLevel(saved_level)
        structlog.reset_defaults()


def _lines(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_library_lines_are_the_same_json_as_the_project_s(configured: io.StringIO) -> None:
    log = setup_logging("worker", "w1", stream=configured)
    log.info("group_opened", group=3)
    logging.getLogger("aiohttp.server").error("Error handling request from %s", "10.0.0.9")
    try:
        raise ConnectionResetError("peer went away")
    except ConnectionResetError:
        logging.getLogger("pysyncobj.syncobj").exception("failed _onTick in _autoTickThread")
    logging.getLogger("asyncio").error("Task exception was never retrieved")
    # Below warning, a library's records are dropped (aiohttp's access lines, PySyncObj's info).
    logging.getLogger("aiohttp.access").info("127.0.0.1 GET /healthz 200")
    own, server, raft, loop = _lines(configured)
    assert own["event"] == "group_opened" and own["group"] == 3
    for line, logger in ((server, "aiohttp.server"), (raft, "pysyncobj.syncobj"), (loop, "asyncio")):
        assert set(own) - {"group"} <= set(line), line  # event, level, timestamp, proc, node
        assert line["logger"] == logger and line["level"] == "error"
        assert (line["proc"], line["node"]) == ("worker", "w1")
        assert line["timestamp"].endswith("Z") and line["timestamp"][:4] == own["timestamp"][:4]
    assert server["event"] == "Error handling request from 10.0.0.9"
    assert "ConnectionResetError: peer went away" in raft["exception"]


def test_configuring_again_replaces_the_handler_rather_than_doubling_lines(configured: io.StringIO) -> None:
    setup_logging("meta", "m1", stream=io.StringIO())
    setup_logging("meta", "m1", stream=configured)
    logging.getLogger("pysyncobj.syncobj").warning("Failed to store full dump")
    [line] = _lines(configured)
    assert (line["event"], line["level"], line["logger"]) == ("Failed to store full dump", "warning",
                                                              "pysyncobj.syncobj")
