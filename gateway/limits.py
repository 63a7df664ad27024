"""The limits and header values of the gateway's public API.

`gateway/routes.py` enforces them and `gateway/openapi.py` documents them:
both read them here, so the reference cannot drift from the checks (and
openapi.py need not import routes.py, which serves it).
"""
from __future__ import annotations

MAX_ID_BYTES = 256
MAX_BATCH = 1000
MAX_K = 1000
MAX_DEADLINE_MS = 300_000
MAX_BODY_BYTES = 1 << 20  # GatewayConfig.max_body_bytes's default
MAX_DOC_BYTES = 1 << 20  # the workers' admission limit on a doc's JSON encoding
MAX_DOC_DEPTH = 254  # the deepest nesting orjson encodes (it reads deeper)
MAX_REQUEST_ID = 100  # characters of x-request-id
OPERATOR_DEADLINE_MS = 10_000
ACKS = ("leader", "quorum", "all")
CONSISTENCIES = ("strong", "follower")
SIGNAL_MODES = ("incr", "set")
