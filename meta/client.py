"""Async client of the metadata service for workers, gateways and topoctl.

It knows every meta node's HTTP address, remembers which one answered last
(the leader, when a `not_leader` named it), and retries the others within the
caller's deadline. A connection error, a 5xx or `not_leader` moves on to the
next node; a 4xx is the caller's problem and is raised at once.
"""
from __future__ import annotations

import asyncio
import ssl
import time
from typing import Any, AsyncIterator

import aiohttp
import orjson

from shardgrid.common.tls import TlsConfigError, base_url, connector_ssl


class MetaError(Exception):
    """A definite error answer from meta (the error body's code and message)."""

    def __init__(self, status: int, code: str, message: str, body: dict[str, Any] | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.body = body or {}


class MetaUnreachable(Exception):
    """No meta node gave a usable answer before the deadline."""


class TokenInClear(TlsConfigError):
    """The admin token would go to a plain http:// URL although TLS is configured."""


class MetaClient:
    def __init__(self, addrs: list[str], admin_token: str | None = None,
                 session: aiohttp.ClientSession | None = None, deadline_s: float = 10.0,
                 local_addr: str | None = None, tls: ssl.SSLContext | None = None,
                 middlewares: tuple[Any, ...] = ()) -> None:
        if not addrs:
            raise ValueError("at least one meta address is needed")
        # With `tls`, host:port addresses are https and verified against its CA
        # (a session passed in must have been made with the same context).
        self.tls = tls
        self.addrs = [base_url(a, tls) for a in addrs]
        plain = [a for a in self.addrs if a.startswith("http://")] if tls is not None else []
        if plain:
            # No fallback to plain http once TLS is configured: it would carry tokens
            # and cluster state in clear past whoever can strip TLS on the path.
            raise TlsConfigError(f"TLS is configured, but {', '.join(plain)} is plain http: give meta addresses "
                                 "as host:port or https://")
        self.admin_token = admin_token
        self._session = session
        self._owns_session = session is None
        self._preferred = 0
        self.deadline_s = deadline_s
        self.local_addr = local_addr
        # The request signer of a cluster member (shardgrid/common/peerauth_http.py), used when this client owns its session.
        self.middlewares = middlewares

    async def __aenter__(self) -> "MetaClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None:
            local = (self.local_addr, 0) if self.local_addr else None
            connector = aiohttp.TCPConnector(local_addr=local, ssl=connector_ssl(self.tls))
            self._session = aiohttp.ClientSession(
                connector=connector, middlewares=self.middlewares, json_serialize=lambda o: orjson.dumps(o, option=orjson.OPT_NON_STR_KEYS).decode())
        return self._session

    def _order(self) -> list[int]:
        n = len(self.addrs)
        return [(self._preferred + i) % n for i in range(n)]

    def _learn_leader(self, http: str | None) -> None:
        if not http:
            return
        base = base_url(http, self.tls)
        if base not in self.addrs:
            self.addrs.append(base)
        self._preferred = self.addrs.index(base)

    def prefer(self, http: str) -> None:
        """Try `http` first from now on (e.g. the meta leader a view named)."""
        self._learn_leader(http)

    async def request(self, method: str, path: str, *, json: Any = None, data: bytes | str | None = None,
                      params: dict[str, str] | None = None, deadline_s: float | None = None,
                      attempt_timeout_s: float = 6.0, admin: bool = False) -> tuple[int, Any, dict[str, str]]:
        """Send to meta, following leaders and retrying until `deadline_s` passes.

        Returns (status, parsed body, headers) of the first definite answer.
        """
        deadline = time.monotonic() + (self.deadline_s if deadline_s is None else deadline_s)
        headers = {"Authorization": f"Bearer {self.admin_token}"} if admin and self.admin_token else {}
        last_problem = "no meta node tried"
        backoff = 0.05
        while True:
            for idx in self._order():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise MetaUnreachable(f"no meta node answered in time ({last_problem}); tried {', '.join(self.addrs)}")
                url = self.addrs[idx] + path
                if headers and self.tls is not None and url.startswith("http://"):
                    # TLS is configured, so this address is a mistake (or a downgrade):
                    # never let the token cross it in clear.
                    raise TokenInClear(f"refusing to send the admin token to {self.addrs[idx]} over plain "
                                       "http while TLS is configured: give meta addresses as host:port or https://")
                try:
                    async with self._sess().request(
                            method, url, json=json, data=data, params=params, headers=headers,
                            timeout=aiohttp.ClientTimeout(total=min(attempt_timeout_s, remaining))) as resp:
                        raw = await resp.read()
                        body = _parse(raw, resp.content_type)
                        err = body.get("error", {}) if isinstance(body, dict) else {}
                        # A 5xx is worth another node only when it says so (the
                        # metadata log could not commit here) or names the leader;
                        # anything else (e.g. "group has no ready leader") is the answer.
                        another = err.get("code") == "not_leader" or err.get("retry_elsewhere") or \
                            resp.status in (500, 502)
                        if resp.status < 500 or not another:
                            self._preferred = idx
                            return resp.status, body, dict(resp.headers)
                        last_problem = f"{url}: {resp.status} {err.get('code', '')} {err.get('message', '')}".strip()
                        if err.get("code") == "not_leader" and err.get("leader_http"):
                            self._learn_leader(err.get("leader_http"))
                            break  # start the next pass at the named leader
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                    last_problem = f"{url}: {type(exc).__name__} {exc}".strip()
            await asyncio.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
            backoff = min(backoff * 2, 0.5)

    async def call(self, method: str, path: str, **kw: Any) -> Any:
        """Like `request` but raises `MetaError` for any non-2xx answer."""
        status, body, _ = await self.request(method, path, **kw)
        if status >= 300:
            err = body.get("error", {}) if isinstance(body, dict) else {}
            raise MetaError(status, err.get("code", "unknown"), err.get("message", str(body)), err)
        return body

    # -- verbs ---------------------------------------------------------------------------

    async def cluster(self, deadline_s: float | None = None) -> dict[str, Any]:
        result: dict[str, Any] = await self.call("GET", "/v1/cluster", deadline_s=deadline_s)
        return result

    async def watch(self, after: int = -1, poll_timeout_s: float = 25.0) -> AsyncIterator[dict[str, Any]]:
        """Yield the cluster view each time its revision passes the last one seen.

        Survives meta leader changes and restarts: it keeps retrying forever
        (the caller cancels it).
        """
        while True:
            try:
                view = await self.call("GET", "/v1/cluster",
                                       params={"wait": str(after), "timeout": str(poll_timeout_s)},
                                       deadline_s=poll_timeout_s + 10, attempt_timeout_s=poll_timeout_s + 5)
            except (MetaUnreachable, MetaError):
                await asyncio.sleep(0.2)
                continue
            if view["revision"] > after:
                after = view["revision"]
                yield view

    async def status(self, addr: str, timeout_s: float = 2.0) -> dict[str, Any]:
        """One node's own view of the Raft group (no failover: it is about that node)."""
        async with self._sess().get(base_url(addr, self.tls) + "/v1/status",
                                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            body: dict[str, Any] = orjson.loads(await resp.read())
            return body

    async def get_topology(self) -> tuple[str, int]:
        status, body, headers = await self.request("GET", "/v1/topology")
        if status >= 300:
            err = body.get("error", {}) if isinstance(body, dict) else {}
            raise MetaError(status, err.get("code", "unknown"), err.get("message", ""), err)
        return str(body), int(headers.get("x-topology-revision", headers.get("X-Topology-Revision", "0")))

    async def put_topology(self, text: str, *, dry_run: bool = False,
                           expect_revision: int | None = None) -> dict[str, Any]:
        params = {"dry_run": "1" if dry_run else "0"}
        if expect_revision is not None:
            params["expect_revision"] = str(expect_revision)
        result: dict[str, Any] = await self.call("PUT", "/v1/topology", data=text.encode("utf-8"),
                                                 params=params, admin=True)
        return result

    async def register(self, wid: str, addr: str, zone: str | None, ram: int = 0, disk: int = 0,
                       version: str = "", code_digest: str = "") -> dict[str, Any]:
        body: dict[str, Any] = {"id": wid, "addr": addr, "zone": zone, "version": version,
                                "code_digest": code_digest}
        if ram or disk:
            body.update(available_ram=ram, available_disk=disk)
        result: dict[str, Any] = await self.call("POST", "/v1/workers/register", json=body)
        return result

    async def heartbeat(self, wid: str, report: dict[str, Any], deadline_s: float = 1.0) -> dict[str, Any]:
        result: dict[str, Any] = await self.call("POST", f"/v1/workers/{wid}/heartbeat", json=report,
                                                 deadline_s=deadline_s)
        return result


def _parse(raw: bytes, content_type: str) -> Any:
    if content_type == "application/json":
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            return {"error": {"code": "bad_response", "message": raw[:200].decode("utf-8", "replace")}}
    return raw.decode("utf-8", "replace")
