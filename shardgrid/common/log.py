"""Structured logging: JSON key-value lines on stderr for every server process."""
from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import orjson
import structlog

_ORJSON_OPTS = orjson.OPT_NON_STR_KEYS


def render_json(event: dict[str, Any], **kw: Any) -> str:
    """structlog's JSONRenderer serializer: orjson (a fifth of the stdlib's
    time per line), falling back to the stdlib for what orjson refuses (ints
    beyond 64 bits) so that a log call never raises."""
    try:
        return orjson.dumps(event, default=kw.get("default"), option=_ORJSON_OPTS).decode()
    except TypeError:
        return json.dumps(event, **kw)


def setup_logging(process: str, node_id: str | None = None, level: str | None = None) -> structlog.stdlib.BoundLogger:
    """Configure structlog once per process and return a logger bound to it.

    Level comes from `SHARDGRID_LOG_LEVEL` (default info). PySyncObj logs
    through the stdlib, so stdlib records are routed to the same stream.
    """
    name = (level or os.environ.get("SHARDGRID_LOG_LEVEL", "info")).upper()
    numeric = getattr(logging, name, logging.INFO)
    logging.basicConfig(stream=sys.stderr, level=max(numeric, logging.WARNING), format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=render_json),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    bound: dict[str, str] = {"proc": process}
    if node_id:
        bound["node"] = node_id
    return structlog.get_logger().bind(**bound)
