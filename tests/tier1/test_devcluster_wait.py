"""`wait_groups_ready` against a fake meta whose view changes between polls:
a measurement on a local cluster starts only once every group is led, ready,
by its preferred leader when asked to wait for balance."""
from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web

from shardgrid.devcluster import wait_groups_ready


def _group(leader: str, preferred: str | None, ready: bool = True) -> dict[str, Any]:
    return {"leader": leader, "preferred_leader": preferred, "ready": ready}


class FakeMeta:
    """Serves the views in order, then the last one for ever."""

    def __init__(self, views: list[dict[str, dict[str, Any]]]) -> None:
        self.views = views
        self.polls = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/cluster", self._cluster)
        return app

    async def _cluster(self, request: web.Request) -> web.Response:
        view = self.views[min(self.polls, len(self.views) - 1)]
        self.polls += 1
        return web.json_response({"revision": self.polls, "groups": view})


FAILED_OVER = {"0": _group("w1", "w1"), "1": _group("w1", "w2")}
STILL_MOVING = {"0": _group("w1", "w1"), "1": _group("w2", "w2", ready=False)}
BALANCED = {"0": _group("w1", "w1"), "1": _group("w2", "w2")}


async def test_balanced_waits_until_every_group_has_its_preferred_leader(aiohttp_server: Any) -> None:
    meta = FakeMeta([FAILED_OVER, FAILED_OVER, STILL_MOVING, BALANCED])
    server = await aiohttp_server(meta.app())
    view = await wait_groups_ready([f"127.0.0.1:{server.port}"], deadline_s=10, balanced=True)
    assert view["groups"] == BALANCED
    assert meta.polls == 4


async def test_unbalanced_is_enough_without_balance(aiohttp_server: Any) -> None:
    meta = FakeMeta([FAILED_OVER, BALANCED])
    server = await aiohttp_server(meta.app())
    view = await wait_groups_ready([f"127.0.0.1:{server.port}"], deadline_s=10)
    assert view["groups"] == FAILED_OVER
    assert meta.polls == 1


async def test_balanced_names_the_groups_it_gave_up_on(aiohttp_server: Any) -> None:
    meta = FakeMeta([FAILED_OVER])
    server = await aiohttp_server(meta.app())
    with pytest.raises(TimeoutError, match=r"groups 1 have no ready preferred leader after 0 s"):
        await wait_groups_ready([f"127.0.0.1:{server.port}"], deadline_s=0.3, balanced=True)


class FakeMetaPair:
    """A follower and a leader: only the leader's view says whether a worker is live."""

    def __init__(self, leader_views: list[dict[str, Any]]) -> None:
        self.leader_views = leader_views
        self.polls = {"m1": 0, "m2": 0}
        self.http: dict[str, str] = {}

    def app(self, me: str) -> web.Application:
        app = web.Application()

        async def cluster(request: web.Request) -> web.Response:
            self.polls[me] += 1
            meta = [{"id": n, "http": self.http.get(n, "")} for n in ("m1", "m2")]
            if me == "m1":
                workers = self.leader_views[min(self.polls[me] - 1, len(self.leader_views) - 1)]
            else:  # a follower's view: registration is replicated, liveness is not
                workers = {w: {k: v for k, v in rec.items() if k != "live"}
                           for w, rec in self.leader_views[-1].items()}
            return web.json_response({"revision": 1, "groups": {}, "workers": workers, "meta": meta,
                                      "meta_leader": "m1", "served_by": me})
        app.router.add_get("/v1/cluster", cluster)
        return app


async def test_an_added_worker_is_reported_once_the_meta_leader_hears_it(aiohttp_server: Any) -> None:
    from shardgrid.devcontrol import wait_worker_live

    pair = FakeMetaPair([{}, {"w4": {"state": "available", "live": False}},
                         {"w4": {"state": "available", "live": True}}])
    leader, follower = await aiohttp_server(pair.app("m1")), await aiohttp_server(pair.app("m2"))
    pair.http = {"m1": f"127.0.0.1:{leader.port}", "m2": f"127.0.0.1:{follower.port}"}
    # Asked of the follower first: its view names the leader, whose view alone says `live`.
    assert await wait_worker_live([pair.http["m2"]], "w4", deadline_s=10) == "m1"
    assert pair.polls["m1"] == 3 and pair.polls["m2"] >= 1


async def test_a_worker_never_heard_times_out_saying_how_far_it_got(aiohttp_server: Any) -> None:
    from shardgrid.devcontrol import wait_worker_live

    pair = FakeMetaPair([{"w4": {"state": "available", "live": False}}])
    leader = await aiohttp_server(pair.app("m1"))
    pair.http = {"m1": f"127.0.0.1:{leader.port}"}
    with pytest.raises(TimeoutError, match="w4 is registered \\(available\\), not heard by the meta leader yet"):
        await wait_worker_live([pair.http["m1"]], "w4", deadline_s=1)
    with pytest.raises(TimeoutError, match="w5 is not registered yet after 1 s"):
        await wait_worker_live([pair.http["m1"]], "w5", deadline_s=1)
