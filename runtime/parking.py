"""Test fault points in the workers (see `Parking`)."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Sequence

log = logging.getLogger(__name__)

PARK_PHASES = ("queued", "prefill", "transfer")


class Parking:
    """Fault points for tests: a test arms phases (`arm`); the next request to reach an armed phase
    on this worker is held there (the thread or coroutine that carries it blocks) until `release`,
    so the test can kill the worker that holds that request in a known phase instead of guessing
    with sleeps. Phases: "queued" (a prefill call not yet in the engine; colocated: not yet
    admitted), "prefill" (the prompt computed, its first token not yet out: the engine thread
    waits), "transfer" (a KV layer group's header received by the decode worker, its payload not yet
    read; or, on a prefill worker with the grpc transport, sent and its payload not yet). Unarmed,
    each point is one set lookup."""

    def __init__(self) -> None:
        self._armed: set[str] = set()
        self._released = threading.Event()
        self.parked: dict[str, str] = {}  # request id -> the phase it is held in

    def arm(self, phases) -> None:
        unknown = set(phases) - set(PARK_PHASES)
        if unknown:
            raise ValueError(f"unknown phases {sorted(unknown)}; known: {', '.join(PARK_PHASES)}")
        self._released.clear()
        self._armed = set(phases)

    def release(self) -> None:
        self._armed = set()
        self._released.set()

    def _claim(self, phase: str, request_id: str) -> bool:
        if phase not in self._armed:
            return False
        self._armed.discard(phase)  # one request per arming
        self.parked[request_id] = phase
        log.warning("test fault point: holding request %s in phase %s", request_id, phase)
        return True

    def hold(self, phase: str, request_id: str) -> None:
        """Any thread: blocks while this request is held."""
        if self._armed and self._claim(phase, request_id):
            self._released.wait()

    async def hold_async(self, phase: str, request_id: str) -> None:
        if self._armed and self._claim(phase, request_id):
            await asyncio.to_thread(self._released.wait)


class ParkingEndpoints:
    """The actor methods tests drive a worker's `Parking` with (the worker holds it as
    `self.parking`)."""

    parking: Parking

    async def park_at(self, phases: Sequence[str]) -> None:
        self.parking.arm(phases)

    async def parked(self) -> dict[str, str]:
        return dict(self.parking.parked)

    async def release_parked(self) -> None:
        self.parking.release()
