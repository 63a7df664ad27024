"""Secrets: where they come from and how requests prove they hold them.

A secret is read from a file (`--x-file PATH`) or an environment variable;
files beat the environment so that a unit file can pin them. Tokens are
compared in constant time, and neither secrets nor presented tokens are ever
logged.
"""
from __future__ import annotations

import hmac
import os
from pathlib import Path

from shardgrid.wire import ApiError

_SCHEME = "bearer "
UNAUTHORIZED_MESSAGE = "this operation needs the admin token (Authorization: Bearer ...)"


def read_secret(path: str | None, env_var: str) -> str | None:
    if path:
        value = Path(path).read_text(encoding="utf-8").strip()
        if not value:
            raise ValueError(f"secret file {path} is empty")
        return value
    value = os.environ.get(env_var, "").strip()
    return value or None


def bearer_token(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header; None when there is no header.

    A header that is there but is not exactly one scheme, one space and a
    non-empty token of UTF-8 text is `unauthorized`, never a 500: aiohttp
    hands undecodable bytes over as lone surrogates, which `.encode()` refuses."""
    if header is None:
        return None
    if not header[:len(_SCHEME)].lower() == _SCHEME:
        raise ApiError("unauthorized", "the Authorization header must be `Bearer TOKEN`")
    token = header[len(_SCHEME):]
    if not token or token != token.strip():
        raise ApiError("unauthorized", "the Authorization header must be `Bearer TOKEN` (one space, no blanks)")
    try:
        token.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError("unauthorized", "the Authorization header is not UTF-8 text") from None
    return token


def bearer_ok(header: str | None, token: str | None) -> bool:
    """Whether `header` presents `token` (always True when no token is configured)."""
    if token is None:
        return True
    try:
        presented = bearer_token(header)
    except ApiError:
        return False
    if presented is None:
        return False
    return hmac.compare_digest(presented.encode("utf-8"), token.encode("utf-8"))


def check_bearer(header: str | None, token: str | None) -> None:
    """Raise `unauthorized` unless `header` is `Bearer <token>` (no-op when no token is configured)."""
    if not bearer_ok(header, token):
        raise ApiError("unauthorized", UNAUTHORIZED_MESSAGE)
