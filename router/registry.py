"""The requests in flight on the router: one `RequestRecord` per client request, from admission to
its end (its id stays claimed all that time), and the `Route` of its current attempt (which workers
hold it, which of them are done with it). Aborting a request, and settling an attempt (counts down,
an abort wherever blocks may remain), happen here."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Optional

from router.counting import Count
from router.failures import DuplicateRequestError, RequestAborted
from router.pools.workers import WorkerHandle
from router.token_stream import Inbox, TokenStreams


@dataclass
class Route:
    """Which workers hold a request (one attempt of it), and which of them are done with it."""

    # the id the workers know this attempt by (the request id, then id~1, id~2...)
    worker_request_id: str
    prefill: Optional[WorkerHandle]
    decode: WorkerHandle
    inbox: Inbox  # the decode worker's chunks for this attempt
    # first token back and the KV acknowledged (or nothing to hand off)
    prefill_released: bool = False
    decode_finished: bool = False
    # the attempt counted in each worker's `in_flight`; the prefill worker's ends with its call
    decode_count: Optional[Count] = None
    prefill_count: Optional[Count] = None


@dataclass
class RequestRecord:
    """A client request from admission to its end."""

    request_id: str
    aborted: asyncio.Future  # done once `Registry.abort` was called for it
    route: Optional[Route] = None  # the current attempt, once its workers are chosen

    async def unless_aborted(self, awaitable, every_s: Optional[float] = None, tick=None):
        """`awaitable`'s result, or RequestAborted as soon as the request is aborted (the awaitable
        is then cancelled, as it is when the caller is). `tick()` runs every `every_s` meanwhile."""
        task = asyncio.ensure_future(awaitable)
        try:
            while True:
                if self.aborted.done():
                    raise RequestAborted()
                await asyncio.wait(
                    (task, self.aborted), timeout=every_s, return_when=asyncio.FIRST_COMPLETED
                )
                if task.done():
                    return task.result()
                if tick is not None and not self.aborted.done():
                    tick()
        finally:
            if not task.done():
                task.cancel()


def choice_request_id(request_id: str, index: int) -> str:
    """Choice `index` of an n > 1 request runs as its own request (router/choices.py); choice 0
    keeps the request's id."""
    return f"{request_id}#{index}" if index else request_id


class Registry:
    """`client` is the router's `WorkerClient` (aborts on settling)."""

    def __init__(self, streams: TokenStreams, client):
        self._streams = streams
        self._client = client
        self._records: dict[str, RequestRecord] = {}

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._records

    def get(self, request_id: str) -> Optional[RequestRecord]:
        return self._records.get(request_id)

    def claim(self, request_id: str) -> RequestRecord:
        """DuplicateRequestError when a request with this id is in flight."""
        if request_id in self._records:
            raise DuplicateRequestError(f"request_id: {request_id!r} is already in flight")
        record = self._records[request_id] = RequestRecord(
            request_id, asyncio.get_running_loop().create_future()
        )
        return record

    def release(self, record: RequestRecord) -> None:
        """The request ended: its attempt is settled and its id free again."""
        self.settle(record)
        del self._records[record.request_id]

    def track(
        self,
        record: RequestRecord,
        worker_request_id: str,
        prefill: Optional[WorkerHandle],
        decode: WorkerHandle,
    ) -> Route:
        """The attempt's route: counted on its workers, its inbox open before any call that could
        make the decode worker emit."""
        record.route = Route(
            worker_request_id,
            prefill,
            decode,
            self._streams.open(worker_request_id, decode),
            prefill_released=prefill is None,
            decode_count=Count(decode, "in_flight"),
            prefill_count=Count(prefill, "in_flight") if prefill is not None else None,
        )
        return record.route

    def settle(self, record: RequestRecord) -> None:
        """Forgets a request's current attempt: counts down, and an abort wherever it may still hold
        blocks."""
        route, record.route = record.route, None
        if route is None:
            return
        wid = route.worker_request_id
        self._streams.close(wid)
        if route.prefill is not None:
            if not route.prefill_released and not route.prefill.is_dead:
                self._client.abort(route.prefill, wid)
        for count in (route.prefill_count, route.decode_count):
            if count is not None:
                count.release()
        if not route.decode_finished and not route.decode.is_dead:
            self._client.abort(route.decode, wid)

    def choices_of(self, request_id: str) -> list[str]:
        """The ids in flight of an n > 1 request's other choices (router/choices.py)."""
        prefix = choice_request_id(request_id, 1)[:-1]
        return [
            other
            for other in self._records
            if other.startswith(prefix) and other[len(prefix) :].isdigit()
        ]

    def abort(self, request_id: str) -> bool:
        """Ends a request in flight at once (its stream's last item has finish reason "abort"); its
        workers are aborted as it ends. False when no such request is in flight."""
        record = self._records.get(request_id)
        if record is None:
            return False
        if not record.aborted.done():
            record.aborted.set_result(None)
        if record.route is not None:  # a consumer waiting for tokens wakes up
            inbox = self._streams.inbox(record.route.worker_request_id)
            if inbox is not None:
                inbox.put_nowait(RequestAborted())
        return True
