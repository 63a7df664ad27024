"""`shardgrid bench --client wrk`: the load is wrk's (a native client), one Lua script per workload.

The Python senders (load.py) cost the machine CPU of their own, and not the
same per request for shardgrid (raw HTTP) as for etcd (JSON gateway, or
gRPC): on a small machine that CPU is taken from the servers unequally. wrk
is a C load generator with the same cost on both sides. It runs a closed
loop only (`-c N` connections, each sending its next request once the last
is answered) — open loop (`--rate`) and mixes stay with the Python senders.

What the scripts send (the same requests as load.py's targets, except that
every request writes fresh keys: `<prefix><thread:03d><counter:012d>`):

- shardgrid put:   `PUT /items/{key}` with the `{"v": "..."}` doc of
  `--value-bytes`, content-type JSON, x-request-id (unique), x-ack and
  x-deadline-ms when given;
- shardgrid batch: `POST /batch` `{"writes": [{"op": "put_item", "id": KEY,
  "doc": DOC}, ...]}` of N distinct keys, same headers;
- etcd put:        `POST /v3/kv/put` `{"key": b64(KEY), "value": b64(DOC)}`;
- etcd batch:      `POST /v3/kv/txn` `{"success": [{"request_put": {...}}, ...]}`.

The keys are base64-encoded in Lua without a per-byte loop: the thread's
prefix (a multiple of 3 bytes) once, then the 12-digit counter as four
3-digit groups from a 1000-entry table (base64 of 3-byte-aligned pieces
concatenates).

Every answer goes through `response()`, which counts 2xx answers (for a
batch: a 200 whose body has no `"error"`), the others by status; `done()`
prints one line `SGWRK {json}` with the requests, the ok ones, the
records they acknowledged, errors by kind and latency percentiles (µs).
The tool parses that line, never wrk's human-readable text.
"""
from __future__ import annotations

import base64
import json
import math
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

MARKER = "SGWRK "
THREADS = 2
PERCENTILES = (("p50", 50), ("p90", 90), ("p99", 99), ("p999", 99.9))


class WrkError(RuntimeError):
    pass


def find_wrk() -> str:
    path = shutil.which("wrk")
    if path is None:
        raise FileNotFoundError("no wrk binary on PATH; install it with `apt-get install -y wrk`")
    return path


@dataclass(frozen=True)
class Workload:
    """One wrk run's requests: the target's protocol, single puts or batches of `batch`."""

    target: str  # "shardgrid" or "etcd"
    doc: bytes  # the JSON document every put writes
    key_prefix: str  # made unique per run and round by the caller
    batch: int = 0
    ack: str | None = None
    deadline_ms: int | None = None

    @property
    def records_per_request(self) -> int:
        return self.batch or 1


def lua_str(s: str | bytes) -> str:
    """A Lua string literal of `s` (bytes kept as they are)."""
    data = s.encode() if isinstance(s, str) else s
    out = []
    for b in data:
        c = chr(b)
        if c in '"\\':
            out.append("\\" + c)
        elif 0x20 <= b < 0x7F:
            out.append(c)
        else:
            out.append(f"\\{b:03d}")
    return '"' + "".join(out) + '"'


def padded_prefix(prefix: str) -> str:
    """`prefix` padded with '-' to a multiple of 3 bytes (what the Lua side's base64 relies on)."""
    return prefix + "-" * (-len(prefix) % 3)


def wrk_key(prefix: str, thread: int, counter: int) -> str:
    """The key the script writes for request `counter` of thread `thread` (for tests and docs)."""
    return f"{padded_prefix(prefix)}{thread:03d}{counter:012d}"


_LUA_COMMON = r"""
local B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

local function b64(s)
  local out, n = {}, #s
  for i = 1, n, 3 do
    local a, b, c = s:byte(i, i + 2)
    b = b or 0
    c = c or 0
    local v = a * 65536 + b * 256 + c
    local q1, q2 = math.floor(v / 262144) % 64, math.floor(v / 4096) % 64
    local q3, q4 = math.floor(v / 64) % 64, v % 64
    out[#out + 1] = B64:sub(q1 + 1, q1 + 1) .. B64:sub(q2 + 1, q2 + 1)
      .. (i + 1 <= n and B64:sub(q3 + 1, q3 + 1) or "=") .. (i + 2 <= n and B64:sub(q4 + 1, q4 + 1) or "=")
  end
  return table.concat(out)
end

local threads = {}
local addrs = {}

function setup(thread)
  local n = #threads + 1
  thread:set("tid", n)
  if #addrs > 0 then
    thread.addr = addrs[(n - 1) % #addrs + 1]
  end
  table.insert(threads, thread)
end

local counter = 0
local prefix, prefix64
local DIG = {}
ok, records, nonok = 0, 0, {}

function init(args)
  prefix = PREFIX .. string.format("%03d", tid)
  prefix64 = b64(prefix)
  for i = 0, 999 do
    local d = string.format("%03d", i)
    DIG[d] = b64(d)
  end
end

local function next_key()
  counter = counter + 1
  local c = string.format("%012d", counter)
  return prefix .. c, prefix64 .. DIG[c:sub(1, 3)] .. DIG[c:sub(4, 6)] .. DIG[c:sub(7, 9)] .. DIG[c:sub(10, 12)]
end

function response(status, headers, body)
  if status >= 200 and status < 300 and not (BATCH_BODY_ERRORS and body and body:find('"error"', 1, true)) then
    ok = ok + 1
    records = records + RECORDS
  else
    local k = "http_" .. status
    if status >= 200 and status < 300 then
      k = "record_errors"
    end
    nonok[k] = (nonok[k] or 0) + 1
  end
end

local function jnum(x)
  return string.format("%.1f", x)
end

function done(summary, latency, requests)
  local tok, trec, codes = 0, 0, {}
  for _, t in ipairs(threads) do
    tok = tok + (t:get("ok") or 0)
    trec = trec + (t:get("records") or 0)
    for k, v in pairs(t:get("nonok") or {}) do
      codes[k] = (codes[k] or 0) + v
    end
  end
  local e = summary.errors
  local parts = {}
  for k, v in pairs(codes) do
    parts[#parts + 1] = '"' .. k .. '":' .. v
  end
  for _, k in ipairs({"connect", "read", "write", "timeout"}) do
    if e[k] > 0 then
      parts[#parts + 1] = '"' .. k .. '":' .. e[k]
    end
  end
  local lat = {}
  for _, p in ipairs(PERCENTILES) do
    lat[#lat + 1] = '"' .. p[1] .. '":' .. jnum(latency:percentile(p[2]))
  end
  lat[#lat + 1] = '"mean":' .. jnum(latency.mean)
  lat[#lat + 1] = '"max":' .. jnum(latency.max)
  io.write("\n" .. MARKER .. '{"requests":' .. summary.requests .. ',"ok":' .. tok .. ',"records":' .. trec
    .. ',"duration_us":' .. summary.duration .. ',"bytes":' .. summary.bytes
    .. ',"errors":{' .. table.concat(parts, ",") .. '},"latency_us":{' .. table.concat(lat, ",") .. '}}\n')
end
"""


def lua_script(w: Workload, addrs: list[tuple[str, int]] | None = None) -> str:
    """The whole Lua script of workload `w`; `addrs` (host, port) spread wrk's threads over
    several endpoints (thread i -> addrs[i % len]); none: the URL wrk is given."""
    if w.target not in ("shardgrid", "etcd"):
        raise ValueError(f"wrk drives shardgrid or etcd, not {w.target!r}")
    prefix = padded_prefix(w.key_prefix)
    head = [f"-- shardgrid bench --client wrk: {w.target} {'batch of %d' % w.batch if w.batch else 'single puts'}",
            f"PREFIX = {lua_str(prefix)}",
            f"MARKER = {lua_str(MARKER)}",
            f"RECORDS = {w.records_per_request}",
            f"BATCH_BODY_ERRORS = {'true' if (w.batch and w.target == 'shardgrid') else 'false'}",
            "PERCENTILES = {" + ", ".join(f'{{"{n}", {p}}}' for n, p in PERCENTILES) + "}",
            f"DOC = {lua_str(w.doc)}"]
    if w.target == "etcd":
        head.append(f"DOC64 = {lua_str(base64.b64encode(w.doc))}")
    text = "\n".join(head) + "\n" + _LUA_COMMON
    if addrs:
        lookups = ", ".join(f"wrk.lookup({lua_str(h)}, {lua_str(str(p))})[1]" for h, p in addrs)
        text = text.replace("local addrs = {}", f"local addrs = {{{lookups}}}")
    if w.target == "shardgrid":
        hdr = ['["content-type"] = "application/json"']
        if w.ack:
            hdr.append(f'["x-ack"] = {lua_str(w.ack)}')
        if w.deadline_ms:
            hdr.append(f'["x-deadline-ms"] = "{int(w.deadline_ms)}"')
        text += "\nlocal HEADERS = {" + ", ".join(hdr) + "}\n"
        text += "\nlocal function headers(rid)\n  local h = {}\n  for k, v in pairs(HEADERS) do h[k] = v end\n" \
                "  h[\"x-request-id\"] = rid\n  return h\nend\n"
        if w.batch:
            text += f"""
function request()
  local items, rid = {{}}, nil
  for i = 1, {w.batch} do
    local key = next_key()
    rid = rid or key
    items[i] = '{{"op":"put_item","id":"' .. key .. '","doc":' .. DOC .. '}}'
  end
  return wrk.format("POST", "/batch", headers(rid), '{{"writes":[' .. table.concat(items, ",") .. ']}}')
end
"""
        else:
            text += """
function request()
  local key = next_key()
  return wrk.format("PUT", "/items/" .. key, headers(key), DOC)
end
"""
    else:
        text += '\nlocal HEADERS = {["content-type"] = "application/json"}\n'
        if w.batch:
            text += f"""
function request()
  local items = {{}}
  for i = 1, {w.batch} do
    local _, key64 = next_key()
    items[i] = '{{"request_put":{{"key":"' .. key64 .. '","value":"' .. DOC64 .. '"}}}}'
  end
  return wrk.format("POST", "/v3/kv/txn", HEADERS, '{{"success":[' .. table.concat(items, ",") .. ']}}')
end
"""
        else:
            text += """
function request()
  local _, key64 = next_key()
  return wrk.format("POST", "/v3/kv/put", HEADERS, '{"key":"' .. key64 .. '","value":"' .. DOC64 .. '"}')
end
"""
    return text


# -- the result ---------------------------------------------------------------------------------


def parse_done_line(stdout: str) -> dict[str, Any]:
    """The `SGWRK {...}` line of the script's done(), as a dict; WrkError if it is missing or bad."""
    found = None
    for line in stdout.splitlines():
        if line.startswith(MARKER):
            found = line[len(MARKER):]
    if found is None:
        raise WrkError(f"wrk printed no {MARKER.strip()} line (its output: {stdout[-500:]!r})")
    try:
        d = json.loads(found)
    except ValueError as exc:
        raise WrkError(f"wrk's {MARKER.strip()} line is not JSON: {exc}: {found[:200]!r}") from None
    for k in ("requests", "ok", "records", "duration_us", "errors", "latency_us"):
        if k not in d:
            raise WrkError(f"wrk's {MARKER.strip()} line lacks {k!r}")
    if not isinstance(d["errors"], dict):
        raise WrkError("wrk's errors are not an object")
    return d


def summarize(done: dict[str, Any]) -> dict[str, Any]:
    """The figures of one wrk run from its done() line: throughput, errors, latency in ms."""
    secs = max(1e-6, done["duration_us"] / 1e6)
    errors = {k: int(v) for k, v in sorted(done["errors"].items())}
    lat = {k: round(v / 1000.0, 3) for k, v in done["latency_us"].items()}
    return {"elapsed_s": round(secs, 3), "requests": done["requests"], "ops": done["ok"], "records": done["records"],
            "ops_per_s": round(done["ok"] / secs, 1), "records_per_s": round(done["records"] / secs, 1),
            "errors": {"total": sum(errors.values()), "by_code": errors}, "latency_ms": lat}


# -- running wrk --------------------------------------------------------------------------------


def wrk_argv(binary: str, script: str, url: str, concurrency: int, duration_s: int, timeout_s: float) -> list[str]:
    threads = min(THREADS, concurrency)
    return [binary, "-t", str(threads), "-c", str(concurrency), "-d", f"{int(duration_s)}s", "--latency",
            "--timeout", f"{max(1, math.ceil(timeout_s))}s", "-s", script, url]


@dataclass
class WrkRun:
    done: dict[str, Any]
    cpu_s: float  # wrk's own CPU (user + system)
    wall_s: float
    argv: list[str]


def run_wrk(w: Workload, urls: list[str], concurrency: int, duration_s: int, timeout_s: float,
            before: Callable[[], None] | None = None, binary: str | None = None) -> WrkRun:
    """Run wrk once with `w`'s script; `before` runs just before it starts (the CPU sample)."""
    binary = binary or find_wrk()
    addrs = []
    for u in urls:
        p = urlsplit(u)
        addrs.append((p.hostname or "127.0.0.1", p.port or 80))
    with tempfile.NamedTemporaryFile("w", prefix="sgwrk-", suffix=".lua", delete=False) as f:
        f.write(lua_script(w, addrs if len(addrs) > 1 else None))
        script = f.name
    argv = wrk_argv(binary, script, urls[0].rstrip("/") + "/", concurrency, duration_s, timeout_s)
    try:
        if before is not None:
            before()
        t0, cpu0 = time.monotonic(), _children_cpu()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = proc.communicate(timeout=duration_s + timeout_s + 30)
        except BaseException:
            proc.kill()
            proc.communicate()
            raise
        wall, cpu = time.monotonic() - t0, _children_cpu() - cpu0  # wrk, reaped by communicate()
    finally:
        os.unlink(script)
    if proc.returncode != 0:
        raise WrkError(f"wrk exited with {proc.returncode}: {err.decode(errors='replace')[-500:]}")
    return WrkRun(parse_done_line(out.decode(errors="replace")), round(cpu, 3), wall, argv)


def _children_cpu() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime
