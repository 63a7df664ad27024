"""A gateway serves only while meta has not refused it (gateway/admission.py)."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest
import structlog

from gateway.admission import AdmissionState, keep_admitted
from meta.client import MetaError, MetaUnreachable
from shardgrid.common.identity import SoftwareIdentity
from shardgrid.common.wire import ApiError


class _Meta:
    """Answers each registration with the next of `answers` (an exception is raised)."""

    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers
        self.bodies: list[Any] = []
        self.done = asyncio.Event()

    async def call(self, method: str, path: str, json: Any = None, **_: Any) -> Any:
        assert (method, path) == ("POST", "/v1/gateways/register")
        self.bodies.append(json)
        if not self.answers:
            self.done.set()
            await asyncio.Event().wait()
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


async def _run(answers: list[Any], monkeypatch: pytest.MonkeyPatch) -> tuple[AdmissionState, _Meta]:
    monkeypatch.setattr("gateway.admission.RETRY_S", 0.0)
    monkeypatch.setattr("gateway.admission.ADMISSION_PERIOD_S", 0.0)
    meta, state = _Meta(answers), AdmissionState()
    task = asyncio.create_task(keep_admitted(meta, "g1", "127.0.0.1:8080",  # type: ignore[arg-type]
                                             SoftwareIdentity("0.1.0", "ab" * 16), state, structlog.get_logger()))
    await asyncio.wait_for(meta.done.wait(), 5)
    task.cancel()
    return state, meta


async def test_a_refusal_stops_the_data_path_and_admission_restarts_it(monkeypatch: pytest.MonkeyPatch) -> None:
    refused = MetaError(403, "forbidden", "g1 runs version 0.1.0; settings.allowed_versions admits 0.2.0",
                        {"reason": "version_mismatch"})
    state, meta = await _run([refused], monkeypatch)
    assert (state.state, state.reason) == ("refused", "version_mismatch")
    with pytest.raises(ApiError) as err:
        state.check()
    assert err.value.status == 503 and "version_mismatch" in err.value.message
    assert meta.bodies[0] == {"id": "g1", "addr": "127.0.0.1:8080", "version": "0.1.0", "code_digest": "ab" * 16}
    state, _ = await _run([refused, {"ok": True}], monkeypatch)
    assert state.state == "admitted"
    state.check()


async def test_meta_being_unreachable_does_not_stop_the_data_path(monkeypatch: pytest.MonkeyPatch) -> None:
    state, _ = await _run([MetaUnreachable("no meta node answered"), MetaError(503, "not_leader", "x")], monkeypatch)
    assert state.state == "pending"
    state.check()  # pending serves: a meta outage must not take the gateways down
