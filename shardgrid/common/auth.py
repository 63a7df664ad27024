"""Secrets: where they come from and how requests prove they hold them.

A secret is read from a file (`--x-file PATH`) or an environment variable;
files beat the environment so that a unit file can pin them. A secret file
that its group or other users can read is refused: a secret someone else
could have copied proves nothing. Tokens are compared in constant time, and
neither secrets nor presented tokens are ever logged.
"""
from __future__ import annotations

import hmac
import os
import secrets
import stat
from pathlib import Path

from shardgrid.common.wire import ApiError

_SCHEME = "bearer "
UNAUTHORIZED_MESSAGE = "this operation needs the admin token (Authorization: Bearer ...)"


class SecretFileError(ValueError):
    """A secret file that must not be used (empty, or readable by others)."""


def read_secret(path: str | None, env_var: str) -> str | None:
    if path:
        mode = os.stat(path).st_mode
        # Group or other *write* is as bad as read: whoever can write it can
        # plant a secret of their choice.
        if stat.S_IMODE(mode) & 0o077:
            raise SecretFileError(f"secret file {path} is readable or writable by other users "
                                  f"(mode {stat.S_IMODE(mode):04o}): run `chmod 600 {path}`")
        value = Path(path).read_text(encoding="utf-8").strip()
        if not value:
            raise SecretFileError(f"secret file {path} is empty")
        return value
    value = os.environ.get(env_var, "").strip()
    return value or None


def write_secret(path: Path, value: str) -> None:
    """Create `path` holding `value` (stripped, one trailing newline), mode 0600, atomically."""
    write_secret_bytes(path, (value.strip() + "\n").encode("utf-8"))


def write_secret_bytes(path: Path, data: bytes) -> None:
    """Create `path` holding exactly `data`, mode 0600 from its first byte, atomically.

    The temporary file is created 0600 with O_EXCL (never a world-readable
    moment, never someone else's file reused) and renamed over `path`, so a
    reader sees the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # A random name: a temporary a crashed writer left behind never blocks O_EXCL.
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:  # os.write may write less than asked
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def bearer_token(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header; None when there is no header.

    A header that is there but is not exactly one scheme, one space and a
    non-empty token of UTF-8 text is `unauthorized`, never a 500: aiohttp
    hands undecodable bytes over as lone surrogates, which `.encode()` refuses."""
    if header is None:
        return None
    if header[:len(_SCHEME)].lower() != _SCHEME:
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
