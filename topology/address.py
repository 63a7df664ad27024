"""Parsing of "host:port" addresses as written in the topology file.

Accepted: a hostname or IPv4 address (`127.0.0.1:7001`, `node-1.internal:80`)
or a bracketed IPv6 address (`[::1]:7001`); the port is 1..65535 in decimal.
Two addresses collide when their `address_key`s are equal: the host compared
case-insensitively, the port as a number. Different spellings of one machine
(`localhost` vs `127.0.0.1`) are not resolved: the file is validated without
touching DNS.
"""
from __future__ import annotations

import ipaddress
import re

_HOST_RE = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?")
_PORT_RE = re.compile(r"[0-9]{1,5}")


def parse_address(value: str) -> tuple[str, int]:
    """Split "host:port" into (host, port); ValueError says what is wrong."""
    if value.startswith("["):
        end = value.find("]")
        if end < 0 or value[end + 1 : end + 2] != ":":
            raise ValueError(f"{value!r} is not 'host:port' (IPv6 is written '[addr]:port')")
        host, port_s = value[1:end], value[end + 2 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{host!r} in {value!r} is not an IPv6 address") from None
    else:
        host, sep, port_s = value.rpartition(":")
        if not sep or not host:
            raise ValueError(f"{value!r} is not 'host:port'")
        if ":" in host:
            raise ValueError(f"{value!r} is not 'host:port' (IPv6 is written '[addr]:port')")
        if not _HOST_RE.fullmatch(host):
            raise ValueError(f"{host!r} in {value!r} is not a valid host name or address")
    if not _PORT_RE.fullmatch(port_s):
        raise ValueError(f"port {port_s!r} in {value!r} is not a number in 1..65535")
    port = int(port_s)
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} in {value!r} is out of range 1..65535")
    return host, port


def address_key(value: str) -> tuple[str, int]:
    """What two addresses must share to collide (value must parse)."""
    host, port = parse_address(value)
    if ":" in host:
        host = str(ipaddress.IPv6Address(host))  # canonical form: ::1 == 0:0:0:0:0:0:0:1
    return host.lower(), port
