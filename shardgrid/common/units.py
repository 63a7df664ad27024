"""Byte sizes as operators write them (`8GB`, `512MiB`, `1.5TB`, `4096`) and as we print them."""
from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
MAX_BYTES = 2**63 - 1


def parse_bytes(text: str) -> int:
    """`8GB` -> 8_000_000_000, `512MiB` -> 536_870_912; ValueError with why otherwise."""
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size: a number with an optional unit (B, KB, MB, GB, TB, KiB, MiB, "
                         "GiB, TiB), e.g. 8GB")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value > MAX_BYTES:
        raise ValueError(f"{text!r} is too large")
    return value


def format_bytes(n: int) -> str:
    """1_500_000_000 -> '1.5 GB' (decimal units, as `parse_bytes` reads them back)."""
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= size:
            return f"{n / size:.1f} {unit}".replace(".0 ", " ")
    return f"{n} B"
