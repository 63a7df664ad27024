"""The one rule for entity ids, shared by the gateway (before routing) and the plugin (before the log)."""
from __future__ import annotations

from typing import Any, Callable


def id_problem(value: Any, where: str, max_bytes: int | None, type_name: Callable[[Any], str]) -> str | None:
    """Why `value` is not a usable id (a non-empty str of at most `max_bytes` UTF-8 bytes), or None.

    UTF-8 must encode: msgpack and orjson both refuse lone surrogates.
    """
    if not isinstance(value, str):
        return f"{where} must be a string, got {type_name(value)}"
    if not value:
        return f"{where} must not be empty"
    if value.isascii():
        n = len(value)  # one byte per character, and nothing to fail to encode
    else:
        try:
            n = len(value.encode("utf-8"))
        except UnicodeEncodeError:
            return f"{where} is not valid Unicode text (lone surrogate)"
    if max_bytes is not None and n > max_bytes:
        return f"{where} is {n} bytes of UTF-8; the limit is {max_bytes}"
    return None
