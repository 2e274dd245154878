"""The two interfaces of a KV handoff: `KVSender` on the prefill side, `KVReceiver` on the decode
side.

A handoff moves one request's KV blocks, whole or as layer groups, from a sender's paged cache into
blocks the receiver reserved for it. Ownership is explicit at every step:

Sender (prefill worker)
    start(request_id, block_ids, destination, lease_s, wire)
        The sender takes over the caller's references to `block_ids`; it gives them back to its
        allocator exactly once: on acknowledgement, on abort, or when the lease expires. `wire` is
        the request's wire mode (kvtransfer/codecs.py): each group is encoded before it leaves, and
        decoded into the receiver's cache dtype where it lands.
    send_layers(request_id, layers) -> Optional[KVDelivery]
        Ships layers as soon as they are computed (or all of them at once). The payload is copied
        out of the cache (and encoded) before this returns, so the cache may be written again. A
        returned delivery (ray) is a small message the caller routes to the receiver's `deliver`
        (in serving: the prefill worker, straight to the decode worker); None means it went
        in-band.
    acknowledge(request_id)     the receiver installed everything: blocks are freed.
    abort(request_id)           blocks freed now; the receiver learns in-band (grpc) or through the
                                caller, who calls the receiver's `abort` (ray).
    poll() -> SenderEvents      settles in-band acks and failures and expired leases, freeing
    blocks.

Receiver (decode worker)
    reserve(request_id, num_blocks, timeout_s) -> block ids
        Allocates the blocks before any KV is sent; if not all layers arrive and verify within
        `timeout_s`, the reservation expires and its blocks are freed at the next `poll`.
    reserve_prompt(request_id, prompt_ids, timeout_s) -> (block ids, reused)
        The same for a prompt whose first `reused` blocks this cache already holds: only the blocks
        after them are sent (the sender's `start` gets those).
    deliver(delivery)           installs a routed delivery (ray); in-band transports install by
    themselves. poll() -> ReceiverEvents    ready requests (every layer arrived, every checksum
                                verified) pass their block ids to the caller, who owns them from
                                then on; failed, aborted and expired requests have their blocks
                                freed.
    abort(request_id)           frees the reservation now; the sender learns in-band (grpc) or
                                through the caller, who calls the sender's `abort` (ray).

Both sides touch their allocator only from the thread that calls these methods; transport threads
only write into reserved blocks and note events for `poll`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Optional, Sequence

import torch

from engine.block_manager import BlockAllocator
from engine.kv_cache import KVLayout, PagedKVCache
from kvtransfer import codecs
from kvtransfer.buffers import BufferPool
from kvtransfer.errors import KVTransferError
from kvtransfer.leases import HeldRequest, SenderEvents, SenderLedger
from kvtransfer.reservations import ReceiverEvents, Reservations
from kvtransfer.wire import KVGroupHeader, as_bytes_view, checksum, group_payload_bytes
from protocol.kv_wire import WIRE_MODES

KVDelivery = Any  # a transport's routed message (ray: `RayKVDelivery`); opaque to the caller

DEFAULT_LEASE_S = 30.0


class KVSender(ABC):
    def __init__(self, cache: PagedKVCache, allocator: BlockAllocator, sender_id: str, epoch: int):
        self.cache = cache
        self.layout: KVLayout = cache.layout
        self.sender_id = sender_id
        self.epoch = epoch
        self.ledger = SenderLedger(allocator)
        # Host buffers; pinned when the cache is on a GPU
        # (engine.kv_cache.PagedKVCache.export_blocks stages device KV through them on a side
        # stream).
        self._staging = BufferPool(pin_memory=cache.kv.device.type == "cuda")
        # A transport that streams (grpc) calls this with the request id between a group's header
        # and its payload (tests hold a transfer there: runtime.parking.Parking).
        self.between_header_and_payload: Optional[Callable[[str], None]] = None

    @abstractmethod
    def start(
        self,
        request_id: str,
        block_ids: Sequence[int],
        destination: Optional[str] = None,
        lease_s: float = DEFAULT_LEASE_S,
        wire: str = "none",
    ) -> None: ...

    def _hold(
        self, request_id: str, block_ids: Sequence[int], lease_s: float, wire: str
    ) -> HeldRequest:
        """The ledger's hold of a started request, under the wire mode this transport can send."""
        if wire not in WIRE_MODES:
            raise ValueError(f"wire mode must be one of {', '.join(WIRE_MODES)}, got {wire!r}")
        return self.ledger.hold(request_id, list(block_ids), lease_s, self._usable_wire(wire))

    def _usable_wire(self, wire: str) -> str:
        """`wire`, or what this transport sends instead (rdt on a GPU: no lossless, which needs
        the host)."""
        return wire

    def wire_sent(self, request_id: str) -> tuple[str, int]:
        """(the wire modes its groups went in, "+"-joined; the bytes on the wire) of a request sent
        so far."""
        held = self.ledger.get(request_id)
        return "+".join(sorted(held.wire_modes)) or held.wire, held.wire_bytes

    @abstractmethod
    def send_layers(self, request_id: str, layers: slice = slice(None)) -> Optional[KVDelivery]: ...

    def acknowledge(self, request_id: str) -> None:
        self._drop(self.ledger.release(request_id), aborted=False)

    def abort(self, request_id: str) -> None:
        self._drop(self.ledger.release(request_id), aborted=True)

    def poll(self) -> SenderEvents:
        acknowledged, failed, expired = self.ledger.settle()
        for held in expired:
            self._drop(held, aborted=True)
        return SenderEvents(tuple(acknowledged), tuple(failed))

    def close(self) -> None:
        for request_id in self.ledger.request_ids():
            self.abort(request_id)

    def _drop(self, held: Optional[HeldRequest], aborted: bool) -> None:
        """Tear down a released request's transport state (close its stream, drop its refs) and, if
        `aborted`, tell the receiver where the transport can."""

    def _export(
        self,
        held: HeldRequest,
        layers: slice,
        staging: Optional[BufferPool] = None,
        checksum_of: Optional[Callable[[torch.Tensor], int]] = None,
    ) -> tuple[KVGroupHeader, torch.Tensor, torch.Tensor]:
        """Copy a layer group into a staging buffer (of `staging`, else the host pool), encode it in
        the request's wire mode and take the checksum of the wire bytes (`checksum_of`, else the
        transport's); returns (header, what to ship: the exported tensor or its flat uint8 wire
        bytes, the buffer to release once the payload has been shipped)."""
        start, stop, step = layers.indices(self.layout.num_layers)
        if step != 1 or start >= stop:
            raise ValueError(f"layers must be a non-empty contiguous range, got {layers}")
        sent = set(range(start, stop))
        if sent & held.layers_sent:
            raise ValueError(
                f"layers [{start}, {stop}) of request {held.request_id!r} were already sent"
            )
        held.layers_sent |= sent
        num_bytes = group_payload_bytes(self.layout, stop - start, len(held.block_ids))
        buffer = (staging or self._staging).acquire(num_bytes)
        data = self.cache.export_blocks(held.block_ids, slice(start, stop), out=buffer)
        mode, wire = codecs.encode(data, held.wire)
        if mode != "none":
            data = wire
        held.wire_modes.add(mode)
        held.wire_bytes += wire.numel()
        header = KVGroupHeader(
            held.request_id,
            self.sender_id,
            self.epoch,
            self.layout,
            start,
            stop,
            len(held.block_ids),
            wire.numel(),
            (checksum_of or self._checksum)(data),
            wire=mode,
        )
        return header, data, buffer

    def _checksum(self, data: torch.Tensor) -> int:
        """The header's checksum of an exported group (XXH3-64 of its bytes; rdt on device memory
        differs)."""
        return checksum(as_bytes_view(data))

    def all_layers_sent(self, held: HeldRequest) -> bool:
        return len(held.layers_sent) == self.layout.num_layers


class KVReceiver(Reservations, ABC):
    """The receiving end: its reservations (kvtransfer/reservations.py), plus where senders reach
    it."""

    def __init__(self, cache: PagedKVCache, allocator: BlockAllocator):
        super().__init__(cache, allocator)
        self.layout: KVLayout = cache.layout

    @property
    def address(self) -> Optional[str]:
        """Where senders reach this receiver (grpc: host:port; ray on a GPU: `cuda:<GPU UUID>`, the
        GPU a sender shares its KV on by CUDA IPC); None where deliveries are routed."""
        return None

    def deliver(self, delivery: KVDelivery) -> bool:
        raise NotImplementedError(f"{type(self).__name__} receives in-band; nothing to deliver")

    def _install_routed(
        self, encoded_header: bytes, receive: Callable[[KVGroupHeader], bool]
    ) -> bool:
        """A routed delivery (ray, rdt): its header decoded and checked, then `receive(header)`
        fetches and installs the payload; True once the request has all its layers. On any
        `KVTransferError` the request fails (its blocks freed at the next `poll`) and the error is
        raised."""
        header = None
        try:
            header = KVGroupHeader.decode(encoded_header, self.layout)
            self.check(header)
            return receive(header)
        except KVTransferError as error:
            request_id = header.request_id if header is not None else error.request_id
            if request_id is not None:
                self.fail(request_id, error)
            raise

    def close(self) -> None:
        self.cancel_all()


__all__ = [
    "KVSender",
    "KVReceiver",
    "KVDelivery",
    "SenderEvents",
    "ReceiverEvents",
    "KVTransferError",
]
