"""The `ray` transport: layer groups travel through the Ray object store, zero-copy on the receiver.

The sender copies a layer group into a reused staging buffer and `ray.put`s its uint8 numpy view
(one copy into the store; a plain `ray.put(tensor)` is ~10x slower here). Only the small
`RayKVDelivery` (header bytes + ObjectRef) travels, routed by the caller to the receiver's `deliver`,
which maps the object read-only (`ray.get` of a numpy array is zero-copy), checks the checksum and installs
it. The sender keeps the ObjectRefs alive with its blocks until ack, abort or lease expiry; if the
sender's process dies, its objects die with it and the receiver's `ray.get` fails the request.
Acks and aborts travel through the caller too: ready on `receiver.poll()` -> `sender.acknowledge`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import ray

from kvtransfer.base import DEFAULT_LEASE_S, KVReceiver, KVSender
from kvtransfer.errors import TransferAbortedError
from kvtransfer.wire import KVGroupHeader, as_bytes_view


@dataclass(frozen=True)
class RayKVDelivery:
    """One layer group in flight: the encoded `KVGroupHeader` and the ObjectRef of its payload."""

    header: bytes
    payload: ray.ObjectRef


class RayKVSender(KVSender):
    def start(
        self,
        request_id: str,
        block_ids: Sequence[int],
        destination: Optional[str] = None,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> None:
        self.ledger.hold(request_id, list(block_ids), lease_s).transport_state = []

    def send_layers(self, request_id: str, layers: slice = slice(None)) -> RayKVDelivery:
        held = self.ledger.get(request_id)
        header, data, buffer = self._export(held, layers)
        try:
            ref = ray.put(as_bytes_view(data))
        finally:
            self._staging.release(buffer)
        held.transport_state.append(ref)  # keeps the object alive until ack / abort / lease expiry
        return RayKVDelivery(header.encode(), ref)


class RayKVReceiver(KVReceiver):
    def __init__(self, cache, allocator, get_timeout_s: float = DEFAULT_LEASE_S):
        super().__init__(cache, allocator)
        self.get_timeout_s = get_timeout_s

    def deliver(self, delivery: RayKVDelivery) -> bool:
        """Install one routed layer group; True once the request has all its layers. Raises a
        `KVTransferError` (and fails the request, freed at the next `poll`) on any problem."""
        return self._install_routed(
            delivery.header, lambda header: self.install(header, self._fetch(delivery, header))
        )

    def _fetch(self, delivery: RayKVDelivery, header: KVGroupHeader):
        try:
            return ray.get(delivery.payload, timeout=self.get_timeout_s)
        except (ray.exceptions.RayError, TimeoutError) as error:
            raise TransferAbortedError(
                f"KV payload of request {header.request_id!r} is unreachable (sender gone?): "
                f"{type(error).__name__}",
                header.request_id,
            ) from error
