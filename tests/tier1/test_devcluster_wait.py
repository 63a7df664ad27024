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
