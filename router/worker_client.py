"""The router's calls to its workers: one method per Ray call, each sending its typed message
(protocol/requests.py). What the flows need not know lives here: a worker's death during a request's
call becomes `WorkerLost` (the request migrates) and its abort `RequestAborted`; best-effort calls
(renew, abort) run in the background, their failures logged. The KV handoff is not among them: the
prefill worker admits the request on its decode worker, which acknowledges the KV back to it, on
every transport (protocol/requests.py's `AdmitRequest`, `AcknowledgeRequest`)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

from protocol.messages import PrefillResult
from protocol.requests import (
    AbortRequest,
    AdmitColocatedRequest,
    PrefillRequest,
    RenewRequest,
    ReserveRequest,
)
from router.failures import WorkerLost, is_actor_death
from router.pools.workers import WorkerHandle
from router.registry import RequestRecord

log = logging.getLogger("router.router")


class WorkerClient:
    def __init__(self) -> None:
        self._background: set[asyncio.Task] = set()

    # -- a request's calls, awaited --------------------------------------------------------------

    async def reserve(
        self, worker: WorkerHandle, record: RequestRecord, request: ReserveRequest
    ) -> Optional[int]:
        """Leading prompt blocks reused, or None: no room. A dead worker's error is raised as is
        (nothing holds the request yet: the caller tries another)."""
        return await record.unless_aborted(worker.actor.reserve.remote(request))

    async def prefill(
        self,
        worker: WorkerHandle,
        record: RequestRecord,
        request: PrefillRequest,
        every_s: Optional[float] = None,
        tick=None,
    ) -> Optional[PrefillResult]:
        """None when the prefill worker was told to abort it. `tick()` runs every `every_s` while
        the prompt waits (the decode reservation's renewal)."""
        return await self._call(worker, record, worker.actor.prefill.remote(request), every_s, tick)

    async def admit_colocated(
        self, worker: WorkerHandle, record: RequestRecord, request: AdmitColocatedRequest
    ) -> None:
        await self._call(worker, record, worker.actor.admit_colocated.remote(request))

    async def abort_now(self, worker: WorkerHandle, request_id: str) -> None:
        await worker.actor.abort.remote(AbortRequest(request_id))

    async def alive(self, worker: WorkerHandle, timeout_s: float = 5.0) -> bool:
        try:
            await asyncio.wait_for(worker.actor.load.remote(), timeout_s)
            return True
        except Exception as error:
            return not is_actor_death(error)

    # -- best effort, in the background ----------------------------------------------------------

    def renew(self, worker: WorkerHandle, request: RenewRequest) -> None:
        self._fire(worker.actor.renew.remote(request))

    def abort(self, worker: WorkerHandle, request_id: str) -> None:
        self._fire(worker.actor.abort.remote(AbortRequest(request_id)))

    # -- helpers -------------------------------------------------------------------------------

    async def _call(
        self, worker: WorkerHandle, record: RequestRecord, call, every_s=None, tick=None
    ):
        """Awaits a worker call for a request; the worker's death becomes WorkerLost (the request
        migrates), the request's abort RequestAborted at once."""
        try:
            result = await record.unless_aborted(call, every_s, tick)
        except Exception as error:
            if is_actor_death(error):
                raise WorkerLost(worker, type(error).__name__) from error
            raise
        worker.last_heard_s = time.monotonic()
        return result

    def _fire(self, awaitable) -> None:
        """Runs a best-effort worker call in the background, logging (not raising) its failure."""

        async def run():
            try:
                await awaitable
            except Exception as error:
                log.warning("background worker call failed: %s", error)

        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
