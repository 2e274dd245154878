"""The sender's side of block ownership: blocks held for in-flight handoffs, each under a lease.

The prefill worker hands a request's block references to the sender at `hold`; from then on the
sender owns them and gives them back to the allocator exactly once: when the receiver acknowledges,
when either side aborts, or when the lease expires. Only the owner's thread calls these methods (the
allocator is not thread-safe); transports report acks and failures from their own threads through
`SenderLedger.note_*`, which `settle` applies.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from engine.block_manager import BlockAllocator
from kvtransfer.errors import KVTransferError, LeaseExpiredError


@dataclass
class HeldRequest:
    request_id: str
    block_ids: list[int]
    lease_deadline_s: float
    layers_sent: set[int] = field(default_factory=set)
    wire: str = "none"  # the wire mode asked for (kvtransfer/codecs.py)
    # what went on the wire so far: its bytes, and the modes its groups used (a lossless group that
    # did not shrink goes as none)
    wire_bytes: int = 0
    wire_modes: set[str] = field(default_factory=set)
    # the transport's (ray: its ObjectRefs or shared device buffers; grpc: the open stream);
    # dropped with the blocks
    transport_state: Any = None


@dataclass(frozen=True)
class SenderEvents:
    """What `KVSender.poll` settled since the last poll: ownership of these blocks has ended."""

    acknowledged: tuple[str, ...] = ()
    failed: tuple[tuple[str, KVTransferError], ...] = ()


class SenderLedger:
    def __init__(self, allocator: BlockAllocator, clock: Callable[[], float] = time.monotonic):
        self.allocator = allocator
        self.clock = clock
        self._held: dict[str, HeldRequest] = {}
        self._notes_lock = threading.Lock()
        self._notes: list[tuple[str, Optional[KVTransferError]]] = []

    def hold(
        self, request_id: str, block_ids: list[int], lease_s: float, wire: str = "none"
    ) -> HeldRequest:
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} is already being sent")
        held = HeldRequest(request_id, list(block_ids), self.clock() + lease_s, wire=wire)
        self._held[request_id] = held
        return held

    def get(self, request_id: str) -> HeldRequest:
        held = self._held.get(request_id)
        if held is None:
            raise KeyError(
                f"request {request_id!r} is not being sent (finished, aborted or expired?)"
            )
        return held

    def release(self, request_id: str) -> Optional[HeldRequest]:
        """Give the request's blocks back to the allocator; a no-op for an unknown id."""
        held = self._held.pop(request_id, None)
        if held is not None:
            self.allocator.free(held.block_ids)
        return held

    def note_done(self, request_id: str, error: Optional[KVTransferError]) -> None:
        """Thread-safe: a transport thread reports an ack (error None) or a failure."""
        with self._notes_lock:
            self._notes.append((request_id, error))

    def settle(self) -> tuple[list[str], list[tuple[str, KVTransferError]], list[HeldRequest]]:
        """Apply noted acks/failures and expire leases; returns (acked, failed, expired-held) with
        blocks already freed; the caller tears down the expired requests' transport state."""
        with self._notes_lock:
            notes, self._notes = self._notes, []
        acknowledged, failed = [], []
        for request_id, error in notes:
            if self.release(request_id) is None:
                continue
            if error is None:
                acknowledged.append(request_id)
            else:
                failed.append((request_id, error))
        now = self.clock()
        expired = [held for held in self._held.values() if now >= held.lease_deadline_s]
        for held in expired:
            self.release(held.request_id)
            failed.append(
                (
                    held.request_id,
                    LeaseExpiredError(
                        f"no acknowledgement for request {held.request_id!r} before its lease "
                        f"expired; {len(held.block_ids)} blocks freed",
                        held.request_id,
                    ),
                )
            )
        return acknowledged, failed, expired

    def request_ids(self) -> list[str]:
        return list(self._held)

    @property
    def num_held_requests(self) -> int:
        return len(self._held)
