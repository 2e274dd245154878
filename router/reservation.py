"""The decode reservation: before a disaggregated prompt is prefilled, KV blocks for it are set
aside on a decode worker, so a transfer never lands where there is no room. Each decode worker is
tried, best first; while all are full the request waits with backoff (counted in `waiting_for_kv`,
bounded by `max_waiting_for_kv`) until `admission_timeout_s`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

from protocol.requests import ReserveRequest
from router.counting import Count
from router.failures import AdmissionTimeoutError, RequestAborted, is_actor_death
from router.overload import OverloadedError
from router.placement import Placement, Prompt
from router.pools.workers import NoWorkerError, WorkerHandle
from router.registry import RequestRecord
from router.worker_client import WorkerClient

_FIRST_DELAY_S = 0.005
_MAX_DELAY_S = 0.1


@dataclass(frozen=True)
class ReservationConfig:
    kv_timeout_s: float  # the reservation's life, renewed while the prompt waits for prefill
    admission_timeout_s: float  # how long a request may wait for room
    max_waiting_for_kv: int
    # prefix routing: the prompt's ids go along, and the worker reuses the prefix it holds
    reuse_prefix: bool


class DecodeReservation:
    """`stats` is the router's `RouterStats` (its `waiting_for_kv`)."""

    def __init__(
        self, config: ReservationConfig, placement: Placement, client: WorkerClient, stats
    ):
        self._config = config
        self._placement = placement
        self._client = client
        self._stats = stats

    async def reserve(
        self, record: RequestRecord, worker_request_id: str, prompt: Prompt
    ) -> tuple[WorkerHandle, int]:
        """Reserves KV blocks for the prompt on a decode worker, trying each (best first) and then
        waiting while all are full, so a busy pool queues. Returns the worker and how many leading
        blocks of the prompt it already held (reused, not sent; prefix routing only: under load
        routing the whole prompt is sent)."""
        config = self._config
        pool = self._placement.decode_pool
        request = ReserveRequest(
            worker_request_id,
            len(prompt.ids),
            config.kv_timeout_s,
            prompt.ids if config.reuse_prefix else None,
        )
        deadline = time.monotonic() + config.admission_timeout_s
        delay_s = _FIRST_DELAY_S
        waiting = False  # counted in `waiting_for_kv` once a full round failed
        with contextlib.ExitStack() as held:
            while True:
                if not pool.ready():
                    raise NoWorkerError(f"no healthy {pool.role} worker")
                for candidate in self._placement.ranked(pool, prompt):
                    decode = candidate.worker
                    if not decode.is_ready:  # it stopped being ready while we tried another
                        continue
                    with Count(decode, "reserving"):  # a drain waits for it
                        reused = await self._try(record, decode, request)
                    if reused is not None:
                        self._placement.chosen(decode.info.role, candidate)
                        return decode, reused
                if time.monotonic() + delay_s > deadline:
                    raise AdmissionTimeoutError(
                        f"no decode worker had KV room for {len(prompt.ids)} prompt tokens within "
                        f"{config.admission_timeout_s:.0f} s"
                    )
                if not waiting:
                    if self._stats.waiting_for_kv >= config.max_waiting_for_kv:
                        raise OverloadedError(
                            f"{self._stats.waiting_for_kv} requests already wait for KV room, the "
                            "limit (--max-waiting); retry later"
                        )
                    held.enter_context(Count(self._stats, "waiting_for_kv"))
                    waiting = True
                await record.unless_aborted(asyncio.sleep(delay_s))
                delay_s = min(delay_s * 2, _MAX_DELAY_S)

    async def _try(
        self, record: RequestRecord, decode: WorkerHandle, request: ReserveRequest
    ) -> int | None:
        """Leading blocks reused on `decode`, or None: no room there now, it died, or it began
        draining."""
        try:
            reused = await self._client.reserve(decode, record, request)
            if reused is None or decode.is_ready:
                return reused
            # A scale-down began draining it while we reserved: hand the blocks back before the
            # drain looks (it waits for `reserving`), and go elsewhere.
            await self._client.abort_now(decode, request.request_id)
            return None
        except (asyncio.CancelledError, RequestAborted):
            # The client left (or aborted) while the reservation was on its way: it may be made by
            # now, and nothing else knows of it.
            self._client.abort(decode, request.request_id)
            raise
        except Exception as error:
            if not is_actor_death(error):
                raise
            decode.mark_dead()  # skipped from now on; the pool manager replaces it
            return None
