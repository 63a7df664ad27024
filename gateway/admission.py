"""A gateway's admission: it tells meta who it is and what it runs, and
serves only while meta has not refused it.

It registers at start and then every ADMISSION_PERIOD_S (meta keeps
gateways as soft state on its leader, shown by `topoctl status`). An
explicit refusal (401 unknown_credentials, 403 version_mismatch) stops the
data path with 503s naming the reason; meta being unreachable does not: the
data path must keep serving through a meta outage.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from meta.client import MetaClient, MetaError, MetaUnreachable
from shardgrid.common.identity import SoftwareIdentity
from shardgrid.common.wire import ApiError

ADMISSION_PERIOD_S = 10.0
REFUSALS = ("unknown_credentials", "version_mismatch", "revoked")
RETRY_S = 1.0


@dataclass
class AdmissionState:
    state: str = "pending"  # pending (not heard yet) | admitted | refused
    reason: str | None = None
    message: str | None = None

    def check(self) -> None:
        """Raise 503 while meta refuses this gateway."""
        if self.state == "refused":
            raise ApiError("unavailable", f"this gateway is not admitted to the cluster ({self.reason}): "
                           f"{self.message}", reason=self.reason)


async def keep_admitted(meta: MetaClient, gateway_id: str, addr: str, identity: SoftwareIdentity,
                        state: AdmissionState, log: Any) -> None:
    """Register with meta now and every ADMISSION_PERIOD_S; runs until cancelled."""
    body = {"id": gateway_id, "addr": addr, "version": identity.version, "code_digest": identity.code_digest}
    while True:
        try:
            await meta.call("POST", "/v1/gateways/register", json=body, deadline_s=5.0)
        except MetaError as exc:
            # A session meta forgot (a restart, an eviction) is not a refusal: only these are.
            if exc.status in (401, 403) and exc.body.get("reason") in REFUSALS:
                if state.state != "refused":
                    log.error("gateway_admission_refused", reason=exc.body.get("reason", exc.code),
                              message=exc.message)
                state.state, state.reason, state.message = "refused", exc.body.get("reason", exc.code), exc.message
            else:
                log.warning("gateway_register_failed", error=str(exc))
            await asyncio.sleep(RETRY_S if state.state != "admitted" else ADMISSION_PERIOD_S)
            continue
        except MetaUnreachable as exc:
            log.warning("gateway_register_failed", error=str(exc))
            await asyncio.sleep(RETRY_S)
            continue
        if state.state != "admitted":
            log.info("gateway_admitted", id=gateway_id, version=identity.version)
        state.state, state.reason, state.message = "admitted", None, None
        await asyncio.sleep(ADMISSION_PERIOD_S)
