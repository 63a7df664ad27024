"""Hostile input against meta's HTTP API changes nothing (issue 25).

One meta node (a single-node PySyncObj group, as tests/tier1/test_meta_api.py)
with the example topology applied and every group ready; the controller is
off so that only requests can change the state. Hypothesis sends every
endpoint requests that are wrong by construction: topologies that do not
validate (malformed or non-UTF-8 YAML, nesting, NaN, type-confused or
out-of-range fields), verbs and CAS calls with wrong types or unknown ids,
registrations and heartbeats with wrong types, watches with bad parameters,
bad Authorization. Every answer must be a 4xx with the one error body, the
replicated state (and the heartbeat soft state) must be unchanged, and the
node must still serve a valid request afterwards.
"""
from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import orjson
import pytest
import structlog
import yaml
from hypothesis import strategies as st

from meta.controller import SoftState
from meta.raft import MetaRaft, RaftPeer
from meta.server import MetaServer, MetaServerConfig, _now_ms
from tests.support.cluster import free_ports
from tests.support.rawhttp import raw_request
from tests.tier1 import fuzz_support
from tests.tier1.fuzz_support import BAD_JSON_BYTES, HUGE_INTS, JSONISH, NON_FINITE, Tally, assert_error_answer, \
    deep_json, deep_text, dumps, fuzz, header_value
from topology.errors import TopologyError
from topology.loader import load_topology
from topology.model import Topology

EXAMPLE = (Path(__file__).resolve().parents[2] / "examples" / "topology.yaml").read_text()
TOKEN = "fuzz-meta-admin"
AUTH = b"Authorization: Bearer " + TOKEN.encode()
MAX_EXAMPLES = 500


@dataclass
class Meta:
    raft: MetaRaft
    server: MetaServer
    port: int


async def _until(cond: Any, what: str) -> None:
    for _ in range(200):
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what} within 10 s")


@pytest.fixture
async def meta(tmp_path: Path, aiohttp_client: Any) -> AsyncIterator[Meta]:
    (raft_port,) = free_ports(1)
    me = RaftPeer("m1", f"127.0.0.1:{raft_port}", "127.0.0.1:0")
    raft = MetaRaft(me, [], tmp_path / "m1", "pw", asyncio.get_running_loop())
    server = MetaServer(raft, MetaServerConfig(admin_token=TOKEN, controller=False), structlog.get_logger())
    try:
        client = await aiohttp_client(server.app())
        await _until(raft.is_leader, "the single meta node to lead")
        # What the controller loop would have set up on the leader.
        server.soft = SoftState(leader_since_ms=_now_ms())
        resp = await client.put("/v1/topology", data=EXAMPLE.encode(), headers={"Authorization": f"Bearer {TOKEN}"})
        assert resp.status == 200, await resp.text()
        for gid, g in raft.sm.groups.items():
            resp = await client.post(f"/v1/groups/{gid}/ready", json={"term": g.term, "leader": g.leader})
            assert resp.status == 200, await resp.text()
        yield Meta(raft, server, client.port)
    finally:
        raft.close()


def _state(m: Meta) -> Any:
    """Everything a request could change: the replicated state and the leader's soft state."""
    soft = m.server.soft
    assert soft is not None
    return (m.raft.sm.view(), copy.deepcopy(m.server.heartbeat_raw), sorted(soft.workers), dict(soft.refused))


@dataclass(frozen=True)
class Case(fuzz_support.Case):
    headers: tuple[bytes, ...] = (AUTH,)  # meta's verbs: past the token check, to the parsing


def _json(value: Any) -> bytes:
    return dumps(value).encode()


_UNREADABLE = object()


def parsed(value: Any) -> Any:
    try:
        return orjson.loads(dumps(value))
    except (orjson.JSONDecodeError, TypeError, ValueError):
        return _UNREADABLE


def bad(ok: Any) -> Any:
    return JSONISH.filter(lambda v: (p := parsed(v)) is _UNREADABLE or not ok(p))


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_str(v: Any) -> bool:
    return isinstance(v, str)


# -- topologies that must not validate -----------------------------------------------------

BASE = yaml.safe_load(EXAMPLE)
CONFUSED = st.one_of(JSONISH, HUGE_INTS, NON_FINITE, st.integers(max_value=-1), st.just(""), st.just([]),
                     st.just({}), st.text(min_size=1, max_size=30))


def _paths(value: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [at] if at else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, at + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, at + (i,))
    return out


PATHS = _paths(BASE)


def _invalid(text: str | bytes) -> bool:
    """The server's own loader refuses it (or fails some other way, which the request must show as a 4xx too)."""
    try:
        load_topology(text, live=Topology.from_dict(_LIVE))
    except TopologyError:
        return True
    except Exception:  # noqa: BLE001 - a loader bug: keep the case, the server must still answer 4xx
        return True
    return False


_LIVE = load_topology(EXAMPLE).to_dict()


@st.composite
def bad_topology(draw: st.DrawFn) -> Case:
    how = draw(st.sampled_from(["field", "field", "field", "delete", "bytes", "yaml", "deep", "nan", "alias"]))
    doc = copy.deepcopy(BASE)
    if how in ("field", "delete", "nan"):
        path = draw(st.sampled_from(PATHS))
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        if how == "delete":
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(NON_FINITE if how == "nan" else CONFUSED)
        try:
            text = yaml.safe_dump(doc).encode()
        except (yaml.YAMLError, OverflowError, ValueError):
            text = b"\xc1"
    elif how == "bytes":
        text = draw(st.one_of(st.binary(max_size=200), BAD_JSON_BYTES,
                              st.binary(min_size=1, max_size=8).map(lambda b: EXAMPLE.encode() + b"\xff" + b)))
    elif how == "yaml":
        text = draw(st.sampled_from([b"[", b"{a: 1", b"a: [", b"!!python/object:os.system {}", b"- - -\n  - :",
                                     b"shards: !!float nan", b"cluster: demo\ncluster: again", b"\t", b"%YAML 9.9\n---",
                                     b"key: @reserved", b"? [a]\n: b", b"&a [*a]", b"*undefined"]))
    elif how == "deep":
        text = draw(deep_json(min_depth=50, max_depth=3000)).encode()
        text = draw(st.sampled_from([text, b"shards: " + text, EXAMPLE.encode() + b"\nextra: " + text]))
    else:
        # The billion laughs: aliases that expand exponentially if anything walks them as a tree.
        levels = draw(st.integers(5, 30))
        lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
        for i in range(1, levels):
            lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
        text = (EXAMPLE + "\n" + "\n".join(lines) + "\n").encode()
    if not _invalid(text):
        text = b"shards: [\xc1"  # this draw happened to validate: make it malformed
    return Case(f"topology:{how}", "PUT", b"/v1/topology", text)


# -- verbs, CAS calls, registrations, heartbeats -------------------------------------------------

VOTERS = ("w1", "w2", "w3")
# Ids no client means as a group: unknown ones, and text int() reads as one
# anyway (" 1", "+1", "1_0", other scripts' digits: "١" is 1).
ODD_GIDS = st.sampled_from(["1.5", "0x1", "1e3", "١", "٢", "0 1", " 1", "+1", "1_0", "٠", "１", "1\u00a0"])
# (Unknown numeric ids are few: on the CAS routes each costs a Raft round trip.)
GID = st.one_of(st.integers(3, 10 ** 30).map(str), st.integers(max_value=-1).map(str),
                st.text(min_size=1, max_size=20).filter(lambda s: not (s.isascii() and s.isdigit())),
                *[ODD_GIDS] * 6)


def _quote(s: str) -> bytes:
    return "".join(c if c.isascii() and c.isalnum() else "".join(f"%{b:02X}" for b in c.encode())
                   for c in s).encode()


@st.composite
def bad_verb(draw: st.DrawFn) -> Case:
    how = draw(st.sampled_from(["transfer", "replicas", "operator", "worker_verb", "gid"]))
    if how == "transfer":
        body = draw(st.one_of(
            bad(lambda b: isinstance(b, dict) and (b.get("to") is None or is_str(b.get("to")))),
            st.builds(lambda v: {"to": v}, bad(lambda v: v is None or is_str(v))),
            st.builds(lambda v: {"to": v}, st.text(max_size=10).filter(lambda s: s not in VOTERS))))
        gid = draw(st.sampled_from(["0", "1", "2"]))
        return Case("verb:transfer", "POST", f"/v1/groups/{gid}/transfer".encode(), _json(body))
    if how == "replicas":
        body = draw(st.one_of(
            JSONISH.filter(lambda v: not isinstance(parsed(v), dict)),
            st.fixed_dictionaries({"add": CONFUSED}), st.fixed_dictionaries({"remove": CONFUSED}),
            st.fixed_dictionaries({"add": st.just("w1"), "remove": st.just("w2")}),
            st.just({}),
        ))
        return Case("verb:replicas", "POST", b"/v1/groups/0/replicas", _json(body))
    if how == "operator":
        return Case("verb:cancel_operator", "DELETE", draw(st.sampled_from([b"/v1/groups/0/operator",
                                                                           b"/v1/groups/7/operator"])))
    if how == "worker_verb":
        wid = draw(st.one_of(st.text(min_size=1, max_size=20).filter(lambda s: s not in VOTERS),
                             st.sampled_from(VOTERS)))
        verb = draw(st.sampled_from([b"gone", b"drain", b"undrain"]))
        auth = () if wid in VOTERS else (AUTH,)  # a known worker without the token: 401
        return Case(f"verb:{verb.decode()}", "POST", b"/v1/workers/" + _quote(wid) + b"/" + verb, b"", auth,
                    (401, 401) if wid in VOTERS else (400, 499))
    return draw(bad_group_id())


@st.composite
def bad_group_id(draw: st.DrawFn) -> Case:
    """Every group route, with a valid body, at a path that names no group a client meant."""
    gid = draw(GID)
    route = draw(st.sampled_from([b"transfer", b"replicas", b"operator", b"ready", b"leader"]))
    body = {b"transfer": {"to": "w2"}, b"replicas": {"add": "w4"}, b"operator": None,
            b"ready": {"term": 1, "leader": "w1"}, b"leader": {"leader": "w2", "expect_term": 1}}[route]
    method = "DELETE" if route == b"operator" else "POST"
    return Case("verb:bad_group_id", method, b"/v1/groups/" + _quote(gid) + b"/" + route,
                b"" if body is None else _json(body))


@st.composite
def bad_cas(draw: st.DrawFn) -> Case:
    """The leader's calls (unauthenticated): ready and leader CAS with fields of the wrong type."""
    route = draw(st.sampled_from(["ready", "leader"]))
    names = ("term", "leader") if route == "ready" else ("expect_term", "leader")
    body: Any = {names[0]: 1, "leader": "w1"}
    how = draw(st.sampled_from(["int", "str", "missing", "not_object"]))
    if how == "int":
        body[names[0]] = draw(bad(is_int))
    elif how == "str":
        body["leader"] = draw(bad(is_str))
    elif how == "missing":
        del body[draw(st.sampled_from(names))]
    else:
        body = draw(JSONISH.filter(lambda v: not isinstance(parsed(v), dict)))
    return Case(f"cas:{route}", "POST", f"/v1/groups/{draw(st.integers(0, 2))}/{route}".encode(), _json(body), ())


def _register_ok(b: Any) -> bool:
    if not isinstance(b, dict) or not is_str(b.get("id")) or not b["id"]:
        return False
    if not is_str(b.get("addr")) or ":" not in b["addr"]:
        return False
    if b.get("zone") is not None and not is_str(b["zone"]):
        return False
    return all(is_int(b.get(k, 0)) and 0 <= b.get(k, 0) <= (1 << 50) for k in ("available_ram", "available_disk"))


@st.composite
def bad_register(draw: st.DrawFn) -> Case:
    body: Any = {"id": "w9", "addr": "127.0.0.1:9", "zone": "z", "available_ram": 1 << 30, "available_disk": 1 << 30}
    how = draw(st.sampled_from(["field", "field", "missing", "not_object"]))
    if how == "field":
        body[draw(st.sampled_from(sorted(body)))] = draw(CONFUSED)
    elif how == "missing":
        del body[draw(st.sampled_from(["id", "addr"]))]
    else:
        body = draw(JSONISH.filter(lambda v: not isinstance(parsed(v), dict)))
    p = parsed(body)
    if p is not _UNREADABLE and _register_ok(p):
        body = {"id": body.get("id") if isinstance(body, dict) else 5, "addr": 5}  # drew a valid one
    return Case("register", "POST", b"/v1/workers/register", _json(body), ())


REPORT = {"term": 1, "role": "follower", "last_term": 1, "last_seq": 5, "commit": 5, "applied": 5,
          "voters": ["w1", "w2", "w3"], "learners": [], "config_seq": 0, "resyncing": False, "write_rate": 1.5,
          "quorum": True, "unheard": [], "leader_silence_ms": 3, "disk_bytes": 100, "snapshot_bytes": None,
          "snapshot_total": None, "snapshot_waiting": False, "persist_p99_ms": 0.5, "persist_ema_ms": 0.2}
INT_FIELDS = ("term", "last_term", "last_seq", "commit", "applied", "config_seq")
OPT_INT_FIELDS = ("leader_silence_ms", "snapshot_bytes", "snapshot_total")
MS_FIELDS = ("persist_p99_ms", "persist_ema_ms")


def _not_int_text(s: str) -> bool:
    try:
        int(s)
    except ValueError:
        return True
    return False


def _int_like(v: Any) -> bool:
    return is_int(v) and 0 <= v < (1 << 63)


@st.composite
def bad_heartbeat(draw: st.DrawFn) -> Case:
    """A heartbeat no worker sends: a wrong type in a report, a bad boot id, a body nobody could read back."""
    how = draw(st.sampled_from(["int", "opt_int", "ms", "quorum", "groups", "group_id", "boot", "deep",
                                "not_object"]))
    rep: dict[str, Any] = dict(REPORT)
    body: Any = {"groups": {"0": rep}, "boot": "b1"}
    if how == "int":
        field = draw(st.sampled_from(INT_FIELDS + ("disk_bytes",)))
        rep[field] = draw(bad(lambda v: _int_like(v) or (v is None and field == "disk_bytes")))
    elif how == "opt_int":
        rep[draw(st.sampled_from(OPT_INT_FIELDS))] = draw(bad(lambda v: v is None or _int_like(v)))
    elif how == "ms":
        rep[draw(st.sampled_from(MS_FIELDS))] = draw(bad(
            lambda v: v is None or (not isinstance(v, (bool, str, list, dict)) and isinstance(v, (int, float))
                                    and 0 <= v < float("inf"))))
    elif how == "quorum":
        rep["quorum"] = draw(bad(lambda v: v is None or isinstance(v, bool)))
    elif how == "groups":
        body["groups"] = draw(st.one_of(bad(lambda v: isinstance(v, dict)),
                                        st.builds(lambda r: {"0": r}, bad(lambda v: isinstance(v, dict)))))
    elif how == "group_id":
        body["groups"] = {draw(st.text(max_size=10).filter(_not_int_text)): rep}
    elif how == "boot":
        body["boot"] = draw(bad(lambda v: v is None or (is_str(v) and 0 < len(v) <= 64)))
    elif how == "not_object":
        body = draw(JSONISH.filter(lambda v: not isinstance(parsed(v), dict)))
    if how == "deep":
        # Any field: meta keeps the raw report and serves it back in /v1/cluster.
        text = deep_text(draw(st.integers(255, 1020)), draw(st.lists(st.booleans(), min_size=1, max_size=3)))
        where = draw(st.sampled_from(["extra", "failed", "error", "voters"]))
        raw = {"extra": '{"groups": {}, "extra": %s}',
               "failed": '{"groups": {"0": {"failed": %s}}}',
               "error": '{"groups": {"0": {"state": "corrupt", "error": %s}}}',
               "voters": '{"groups": {"0": {"voters": %s}}}'}[where] % text
        return Case(f"heartbeat:deep_{where}", "POST", b"/v1/workers/w1/heartbeat", raw.encode(), ())
    wid = draw(st.sampled_from([b"w1", b"w9"]))
    return Case(f"heartbeat:{how}", "POST", b"/v1/workers/" + wid + b"/heartbeat", _json(body), ())


@st.composite
def bad_body_bytes(draw: st.DrawFn) -> Case:
    """Bodies no JSON reader accepts, on every JSON route."""
    method, target, auth = draw(st.sampled_from([
        ("POST", b"/v1/groups/0/transfer", (AUTH,)), ("POST", b"/v1/groups/0/replicas", (AUTH,)),
        ("POST", b"/v1/groups/0/ready", ()), ("POST", b"/v1/groups/0/leader", ()),
        ("POST", b"/v1/workers/register", ()), ("POST", b"/v1/workers/w1/heartbeat", ())]))
    body = draw(st.one_of(BAD_JSON_BYTES, deep_json(min_depth=1025, max_depth=1500).map(str.encode)))
    return Case("malformed_json", method, target, body, auth)


def _wait_ok(wait: bytes, timeout: bytes | None) -> bool:
    try:
        int(wait)
        t = float(timeout) if timeout is not None else 30.0
    except ValueError:
        return False
    return t == t and abs(t) != float("inf")


@st.composite
def bad_watch(draw: st.DrawFn) -> Case:
    texts = st.one_of(st.text(max_size=12).map(str.encode), st.sampled_from([b"nan", b"inf", b"-inf", b"1e999",
                                                                           b"%ff", b"%", b"0x10", b"\xff"]))
    # Past the 4300 digits int() converts; one of them only: the request line holds 8190 bytes.
    wait = draw(st.one_of(texts, st.just(b"9" * 4301)))
    timeout = draw(st.one_of(st.none(), texts))
    if _wait_ok(_unquote(wait), None if timeout is None else _unquote(timeout)):
        wait = b"x"
    query = b"wait=" + _pct(wait) + (b"" if timeout is None else b"&timeout=" + _pct(timeout))
    return Case("watch", "GET", b"/v1/cluster?" + query, b"", ())


def _pct(raw: bytes) -> bytes:
    return b"".join(bytes([c]) if 0x30 <= c <= 0x39 or 0x41 <= c <= 0x5A or 0x61 <= c <= 0x7A or c in b"-.%"
                    else b"%%%02X" % c for c in raw)


def _unquote(raw: bytes) -> bytes:
    from urllib.parse import unquote_to_bytes
    return unquote_to_bytes(raw)


def _auth_ok(v: bytes) -> bool:
    return v[:7].lower() == b"bearer " and v[7:] == TOKEN.encode()


@st.composite
def bad_authorization(draw: st.DrawFn) -> Case:
    method, target, body = draw(st.sampled_from([
        ("PUT", b"/v1/topology", EXAMPLE.replace("lease_ms: 1500", "lease_ms: 1600").encode()),
        ("POST", b"/v1/groups/0/transfer", b'{"to": "w2"}'), ("POST", b"/v1/groups/0/replicas", b'{"add": "w4"}'),
        ("DELETE", b"/v1/groups/0/operator", b""), ("POST", b"/v1/workers/w1/drain", b""),
        ("POST", b"/v1/workers/w1/gone", b""), ("POST", b"/v1/workers/w1/undrain", b"")]))
    headers = draw(st.one_of(st.just(()), header_value(_auth_ok).map(lambda v: (b"Authorization: " + v,)),
                             st.sampled_from([(b"Authorization: Bearer " + TOKEN.encode() + b"\xff",),
                                              (b"Authorization: Basic " + TOKEN.encode(),),
                                              (b"Authorization: Bearer  " + TOKEN.encode(),),
                                              (b"Authorization: Bearer \xc3\x28",)])))
    return Case("bad_authorization", method, target, body, headers, (401, 401))


CASES = st.one_of(bad_topology(), bad_topology(), bad_verb(), bad_group_id(), bad_group_id(), bad_cas(),
                  bad_register(), bad_heartbeat(), bad_heartbeat(), bad_body_bytes(), bad_watch(),
                  bad_authorization())


async def test_hostile_requests_are_4xx_and_change_nothing(meta: Meta, record_property: Any) -> None:
    tally = Tally("meta")
    before = _state(meta)

    async def check(case: Case) -> None:
        # Soft state back to the start, so that a failure replays alone when
        # hypothesis shrinks it (the replicated state is compared, not reset).
        meta.server.heartbeat_raw.clear()
        assert meta.server.soft is not None
        meta.server.soft.workers.clear()
        status, headers, body = await raw_request("127.0.0.1", meta.port, case.method, case.target,
                                                  list(case.headers), case.body)
        assert_error_answer(status, headers, body, case, *case.status)
        assert _state(meta) == before, case.kind

    await fuzz(CASES, check, MAX_EXAMPLES, tally, lambda c: c.kind.split(":")[0])
    # Still serving: a read, a watch, a heartbeat, and an apply that changes something.
    status, _, body = await raw_request("127.0.0.1", meta.port, "GET", b"/v1/cluster", [])
    assert status == 200 and orjson.loads(body)["revision"] == before[0]["revision"]
    status, _, body = await raw_request("127.0.0.1", meta.port, "POST", b"/v1/workers/w1/heartbeat", [],
                                        _json({"groups": {"0": REPORT}, "boot": "b1"}))
    assert status == 200, body
    status, _, body = await raw_request("127.0.0.1", meta.port, "PUT", b"/v1/topology", [AUTH],
                                        EXAMPLE.replace("lease_ms: 1500", "lease_ms: 1600").encode())
    assert status == 200 and orjson.loads(body)["changed"], body
    print(tally.line())
    record_property("fuzz_cases", tally.total)


async def test_an_oversized_topology_is_413_and_changes_nothing(meta: Meta) -> None:
    before = _state(meta)
    body = EXAMPLE.encode() + b"\n#" + b"x" * (1 << 20)
    status, headers, answer = await raw_request("127.0.0.1", meta.port, "PUT", b"/v1/topology", [AUTH], body)
    assert_error_answer(status, headers, answer, "oversized", 413, 413)
    assert _state(meta) == before
