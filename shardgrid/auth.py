"""Secrets: where they come from and how requests prove they hold them.

A secret is read from a file (`--x-file PATH`) or an environment variable;
files beat the environment so that a unit file can pin them. Tokens are
compared in constant time.
"""
from __future__ import annotations

import hmac
import os
from pathlib import Path

from shardgrid.wire import ApiError


def read_secret(path: str | None, env_var: str) -> str | None:
    if path:
        value = Path(path).read_text(encoding="utf-8").strip()
        if not value:
            raise ValueError(f"secret file {path} is empty")
        return value
    value = os.environ.get(env_var, "").strip()
    return value or None


def check_bearer(header: str | None, token: str | None) -> None:
    """Raise `unauthorized` unless `header` is `Bearer <token>` (no-op when no token is configured)."""
    if token is None:
        return
    presented = ""
    if header and header.startswith("Bearer "):
        presented = header[len("Bearer "):].strip()
    if not hmac.compare_digest(presented.encode(), token.encode()):
        raise ApiError("unauthorized", "this operation needs the admin token (Authorization: Bearer ...)")
