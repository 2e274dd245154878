"""The receiver's side of block ownership: reservations that KV layer groups are installed into.

The decode worker reserves a request's blocks (`reserve`, which allocates them) before any KV is
sent. With `reserve_prompt`, the leading blocks of the prompt that this cache already holds (an
earlier turn of the conversation, a shared system prompt) are taken as they are, one more reference
each, and only the blocks after them are sent. Transports install verified layer groups into the
rest from any thread (`install`); a request is ready only once every layer has arrived and passed
its checksum. The allocator is touched only by the owner's thread: in `reserve`, `abort` and `poll`.
`poll` hands ready requests' blocks (reused ones first) to the caller (ownership moves; the caller
frees them when the sequence ends) and frees the blocks of requests that failed, were aborted by the
sender, or whose reservation expired. A reused block is never evicted while reserved: its reference
keeps it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from engine.block_manager import BlockAllocator
from engine.kv_cache import PagedKVCache
from kvtransfer.errors import (
    ChecksumError,
    KVTransferError,
    ReservationExpiredError,
    TransferAbortedError,
    UnknownRequestError,
    WireFormatError,
)
from kvtransfer.wire import KVGroupHeader, checksum, payload_as_kv


@dataclass
class _Reservation:
    request_id: str
    # every block of the prompt: `num_reused` cached ones, then those being sent
    block_ids: list[int]
    num_reused: int
    deadline_s: float
    layers_arrived: list[bool]
    sender: Optional[tuple[str, int]] = None  # (sender id, epoch) bound at the first group
    ready: bool = False
    ready_wall_s: Optional[float] = None  # time.time() its last group was installed
    error: Optional[KVTransferError] = None
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class ReceiverEvents:
    """What `KVReceiver.poll` settled. `ready` maps request id -> block ids now owned by the caller,
    `ready_wall_s` request id -> time.time() its last layer group was installed (the handoff's end:
    the poll may come a decode step later); `failed` requests' blocks were already freed."""

    ready: dict[str, list[int]] = field(default_factory=dict)
    ready_wall_s: dict[str, float] = field(default_factory=dict)
    failed: tuple[tuple[str, KVTransferError], ...] = ()


class Reservations:
    """Every reservation of one receiver (the decode side's `KVReceiver` is one)."""

    def __init__(
        self,
        cache: PagedKVCache,
        allocator: BlockAllocator,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cache = cache
        self.allocator = allocator
        self.clock = clock
        self._lock = threading.Lock()
        self._by_request: dict[str, _Reservation] = {}
        # Called with the request id once a group's header passed `check`, before its payload is
        # read (tests hold a transfer there: runtime.parking.Parking).
        self.before_payload: Optional[Callable[[str], None]] = None
        # Called (any thread) once a layer group was installed or refused, or a request failed: the
        # owner's next `poll` has news (a decode worker wakes its loop instead of polling on a
        # timer).
        self.on_event: Optional[Callable[[], None]] = None

    def reserve(self, request_id: str, num_blocks: int, timeout_s: float) -> list[int]:
        """Allocates `num_blocks` blocks for KV yet to arrive (OutOfBlocksError when they are not
        free)."""
        self._check_new(request_id)
        return self._add(request_id, self.allocator.allocate(num_blocks), 0, timeout_s)

    def reserve_prompt(
        self, request_id: str, prompt_ids: Sequence[int], timeout_s: float
    ) -> tuple[list[int], int]:
        """Blocks for a prompt's KV, reusing the cached blocks of its prefix; returns (all its block
        ids, how many leading ones are reused: the sender skips those)."""
        self._check_new(request_id)
        block_ids, cached_tokens = self.allocator.allocate_prompt(prompt_ids)
        num_reused = cached_tokens // self.allocator.block_size_tokens
        return self._add(request_id, block_ids, num_reused, timeout_s), num_reused

    def _check_new(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._by_request:
                raise ValueError(f"request {request_id!r} already holds a KV reservation")

    def _add(
        self, request_id: str, block_ids: list[int], num_reused: int, timeout_s: float
    ) -> list[int]:
        reservation = _Reservation(
            request_id,
            block_ids,
            num_reused,
            self.clock() + timeout_s,
            [False] * self.cache.layout.num_layers,
        )
        with self._lock:
            self._by_request[request_id] = reservation
        return list(block_ids)

    def renew(self, request_id: str, timeout_s: float) -> bool:
        """Any thread: the reservation's deadline becomes now + `timeout_s` (the sender has not
        started yet: its prompt waits to be prefilled). False when there is no such reservation any
        more."""
        with self._lock:
            reservation = self._by_request.get(request_id)
        if reservation is None:
            return False
        with reservation.lock:
            if reservation.ready or reservation.error is not None:
                return False
            reservation.deadline_s = max(reservation.deadline_s, self.clock() + timeout_s)
        return True

    def _get(self, request_id: str) -> _Reservation:
        with self._lock:
            reservation = self._by_request.get(request_id)
        if reservation is None:
            raise UnknownRequestError(
                f"no KV reservation for request {request_id!r} (never reserved, expired or "
                "aborted)",
                request_id,
            )
        return reservation

    def check(self, header: KVGroupHeader) -> None:
        """Any thread: reject a group before its payload is read (unknown request, wrong block
        count, another sender, layers already installed)."""
        reservation = self._get(header.request_id)
        with reservation.lock:
            self._check_locked(reservation, header)
        if self.before_payload is not None:
            self.before_payload(header.request_id)

    def _check_locked(self, reservation: _Reservation, header: KVGroupHeader) -> None:
        if reservation.error is not None:
            raise reservation.error
        if reservation.ready:
            raise WireFormatError(
                f"request {header.request_id!r} already received all its KV", header.request_id
            )
        if self.clock() >= reservation.deadline_s:
            raise ReservationExpiredError(
                f"KV reservation for request {header.request_id!r} expired", header.request_id
            )
        sender = (header.sender_id, header.sender_epoch)
        if reservation.sender is not None and reservation.sender != sender:
            raise TransferAbortedError(
                f"request {header.request_id!r} is bound to sender {reservation.sender}, not "
                f"{sender}",
                header.request_id,
            )
        if header.num_blocks != len(reservation.block_ids) - reservation.num_reused:
            raise WireFormatError(
                f"request {header.request_id!r}: {header.num_blocks} blocks sent, "
                f"{len(reservation.block_ids) - reservation.num_reused} expected",
                header.request_id,
            )
        if any(reservation.layers_arrived[header.layer_start : header.layer_stop]):
            raise WireFormatError(
                f"request {header.request_id!r}: layers [{header.layer_start}, "
                f"{header.layer_stop}) overlap layers already installed",
                header.request_id,
            )

    def install(
        self, header: KVGroupHeader, payload: Any, payload_checksum: Optional[int] = None
    ) -> bool:
        """Any thread: verify one layer group and write it into the reserved blocks; True once the
        request has all its layers. On a checksum mismatch nothing is written and the request fails.
        `payload_checksum` is the checksum a transport already computed while receiving, if any."""
        try:
            return self._install(header, payload, payload_checksum)
        finally:
            self._notify()

    def _install(
        self, header: KVGroupHeader, payload: Any, payload_checksum: Optional[int]
    ) -> bool:
        reservation = self._get(header.request_id)
        actual = (
            checksum(memoryview(payload)[: header.payload_bytes])
            if payload_checksum is None
            else payload_checksum
        )
        with reservation.lock:
            self._check_locked(reservation, header)
            if actual != header.checksum:
                reservation.error = ChecksumError(
                    f"KV payload of request {header.request_id!r}, layers [{header.layer_start}, "
                    f"{header.layer_stop}): checksum {actual:#018x} != header "
                    f"{header.checksum:#018x}; nothing installed",
                    header.request_id,
                )
                raise reservation.error
            reservation.sender = (header.sender_id, header.sender_epoch)
            self.cache.import_blocks(
                reservation.block_ids[reservation.num_reused :],
                payload_as_kv(payload, header),
                header.layers,
            )
            reservation.layers_arrived[header.layer_start : header.layer_stop] = [True] * (
                header.layer_stop - header.layer_start
            )
            reservation.ready = all(reservation.layers_arrived)
            if reservation.ready:
                reservation.ready_wall_s = time.time()
            return reservation.ready

    def fail(
        self, request_id: str, error: KVTransferError, sender: Optional[tuple[str, int]] = None
    ) -> None:
        """Any thread: mark a request failed (its blocks are freed at the next `poll`). With
        `sender`, only if the reservation is not bound to another sender (a stale epoch cannot abort
        it)."""
        with self._lock:
            reservation = self._by_request.get(request_id)
        if reservation is not None:
            with reservation.lock:
                other_sender = sender is not None and reservation.sender not in (None, sender)
                if reservation.error is None and not reservation.ready and not other_sender:
                    reservation.error = error
            self._notify()

    def _notify(self) -> None:
        if self.on_event is not None:
            self.on_event()

    def abort(self, request_id: str) -> bool:
        """Owner thread: drop a reservation now (ready or not) and free its blocks."""
        with self._lock:
            reservation = self._by_request.pop(request_id, None)
        if reservation is None:
            return False
        with reservation.lock:  # waits out an install in progress; later ones find no reservation
            reservation.error = reservation.error or TransferAbortedError(
                f"request {request_id!r} aborted by the receiver", request_id
            )
            self.allocator.free(reservation.block_ids)
        return True

    def poll(self) -> ReceiverEvents:
        """Owner thread: hand over ready requests, free failed and expired ones."""
        ready: dict[str, list[int]] = {}
        ready_wall_s: dict[str, float] = {}
        failed: list[tuple[str, KVTransferError]] = []
        now = self.clock()
        with self._lock:
            reservations = list(self._by_request.values())
        for reservation in reservations:
            with reservation.lock:
                if reservation.ready:
                    ready[reservation.request_id] = reservation.block_ids
                    ready_wall_s[reservation.request_id] = reservation.ready_wall_s
                elif reservation.error is None and now >= reservation.deadline_s:
                    arrived = sum(reservation.layers_arrived)
                    reservation.error = ReservationExpiredError(
                        f"KV for request {reservation.request_id!r} did not arrive in time "
                        f"({arrived}/{len(reservation.layers_arrived)} layers); reservation freed",
                        reservation.request_id,
                    )
                if reservation.error is not None:
                    self.allocator.free(reservation.block_ids)
                    failed.append((reservation.request_id, reservation.error))
                if reservation.ready or reservation.error is not None:
                    with self._lock:
                        del self._by_request[reservation.request_id]
        return ReceiverEvents(ready, ready_wall_s, tuple(failed))

    def cancel_all(self) -> None:
        for request_id in list(self._by_request):
            self.abort(request_id)
