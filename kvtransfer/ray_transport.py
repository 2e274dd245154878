"""The `ray` transport: layer groups travel through the Ray object store, zero-copy on the receiver.

The sender copies a layer group into a reused staging buffer and `ray.put`s its uint8 numpy view
(one copy into the store; a plain `ray.put(tensor)` is ~10x slower here). Only the small
`RayKVDelivery` (header bytes + ObjectRef) travels, routed by the caller to the receiver's `deliver`
(in serving the prefill worker sends it to the decode worker itself, never through the router),
which maps the object read-only (`ray.get` of a numpy array is zero-copy), checks the checksum and
installs it. The sender keeps the ObjectRefs alive with its blocks until ack, abort or lease expiry;
if the sender's process dies, its objects die with it and the receiver's `ray.get` fails the
request. Acks and aborts travel through the caller too: installed -> `sender.acknowledge` (in
serving the decode worker calls the prefill worker's `acknowledge` itself; aborts come from the
router). Between two workers on one GPU the payload stays on the device (kvtransfer/cuda_ipc.py):
a request whose destination is the receiver's `cuda:<UUID>` address, on the sender's own GPU, is
delivered as a `CudaIpcKVDelivery`; any other is host-staged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import ray
import torch

from kvtransfer import cuda_ipc
from kvtransfer.base import DEFAULT_LEASE_S, KVReceiver, KVSender
from kvtransfer.buffers import BufferPool
from kvtransfer.errors import TransferAbortedError
from kvtransfer.wire import KVGroupHeader, as_bytes_view


@dataclass(frozen=True)
class RayKVDelivery:
    """One layer group in flight: the encoded `KVGroupHeader` and the ObjectRef of its payload."""

    header: bytes
    payload: ray.ObjectRef


@dataclass
class _RayTransfer:
    """A request's transport state on the sender: host-staged (the ObjectRefs of its groups, kept
    alive until released) or by CUDA IPC (the device buffers shared, back to the pool when
    released)."""

    on_device: bool
    refs: list[ray.ObjectRef] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)


class RayKVSender(KVSender):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        device = self.cache.kv.device
        # a receiver on this GPU advertises this address; groups for it are gathered, and stay, on
        # the device
        self._ipc_address = cuda_ipc.address(device)
        self._ipc_device_uuid = cuda_ipc.device_uuid(device) if self._ipc_address else None
        self._device_staging = BufferPool(device=device) if self._ipc_address else None

    def start(
        self,
        request_id: str,
        block_ids: Sequence[int],
        destination: Optional[str] = None,
        lease_s: float = DEFAULT_LEASE_S,
        wire: str = "none",
    ) -> None:
        on_device = self._ipc_address is not None and destination == self._ipc_address
        # on one GPU nothing crosses a wire: the group is shared where it lies, as it is
        held = self._hold(request_id, block_ids, lease_s, "none" if on_device else wire)
        held.transport_state = _RayTransfer(on_device)

    def send_layers(self, request_id: str, layers: slice = slice(None)) -> RayKVDelivery:
        held = self.ledger.get(request_id)
        transfer: _RayTransfer = held.transport_state
        if transfer.on_device:  # the buffer is the payload: kept until released
            header, _, buffer = self._export(held, layers, self._device_staging, _device_checksum)
            transfer.buffers.append(buffer)
            handle = cuda_ipc.share(buffer[: header.payload_bytes])
            return cuda_ipc.CudaIpcKVDelivery(header.encode(), handle, self._ipc_device_uuid)
        header, data, buffer = self._export(held, layers)
        try:
            ref = ray.put(as_bytes_view(data))
        finally:
            self._staging.release(buffer)
        transfer.refs.append(ref)  # keeps the object alive until ack / abort / lease expiry
        return RayKVDelivery(header.encode(), ref)

    def _drop(self, held, aborted: bool) -> None:
        if held is None:
            return
        transfer: _RayTransfer = held.transport_state
        transfer.refs.clear()  # the objects go with the last reference
        for buffer in transfer.buffers:  # a receiver still reading one fails its checksum
            self._device_staging.release(buffer)
        transfer.buffers.clear()


def _device_checksum(data: torch.Tensor) -> int:
    """The checksum a CUDA IPC receiver verifies on its copy, taken where the group lies (int():
    waits for the gather)."""
    from kvtransfer.rdt_transport import device_checksum

    return device_checksum(data.reshape(-1).view(torch.uint8))


class RayKVReceiver(KVReceiver):
    def __init__(self, cache, allocator, get_timeout_s: float = DEFAULT_LEASE_S):
        super().__init__(cache, allocator)
        self.get_timeout_s = get_timeout_s
        self._device_staging: Optional[BufferPool] = None  # CUDA IPC deliveries land here first
        self._address = cuda_ipc.address(cache.kv.device)

    @property
    def address(self) -> Optional[str]:
        """`cuda:<GPU UUID>` for a cache on a GPU: a sender on that GPU shares its KV there."""
        return self._address

    def deliver(self, delivery: RayKVDelivery) -> bool:
        """Install one routed layer group; True once the request has all its layers. Raises a
        `KVTransferError` (and fails the request, freed at the next `poll`) on any problem."""
        if isinstance(delivery, cuda_ipc.CudaIpcKVDelivery):
            return self._install_routed(
                delivery.header, lambda header: self._install_shared(header, delivery)
            )
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

    def _install_shared(self, header: KVGroupHeader, delivery: cuda_ipc.CudaIpcKVDelivery) -> bool:
        """A group in the sender's device memory: copied here, verified on the copy, installed."""
        from kvtransfer.rdt_transport import device_checksum

        device = self.cache.kv.device
        mine = cuda_ipc.device_uuid(device)
        if mine is None or mine != delivery.device_uuid:
            raise TransferAbortedError(
                f"KV of request {header.request_id!r} was shared by CUDA IPC on GPU "
                f"{delivery.device_uuid}, but this receiver's cache is on {mine or device}: "
                "CUDA IPC needs both workers on one GPU",
                header.request_id,
            )
        if self._device_staging is None:
            self._device_staging = BufferPool(device=device)
        buffer = self._device_staging.acquire(header.payload_bytes)
        try:
            local = buffer[: header.payload_bytes]
            try:
                shared = cuda_ipc.open_shared(delivery.handle, device)
                local.copy_(shared[: header.payload_bytes])
                del shared
            except (RuntimeError, OSError) as error:  # sender gone, no shared IPC namespace, ...
                raise TransferAbortedError(
                    f"KV of request {header.request_id!r} shared by CUDA IPC could not be read "
                    f"({type(error).__name__}: {error}); {cuda_ipc.ENV}=0 host-stages it instead",
                    header.request_id,
                ) from error
            ready = self.install(header, local, payload_checksum=device_checksum(local))
            if device.type == "cuda":  # installed before the buffer is reused or the sender acked
                torch.cuda.current_stream(device).synchronize()
            return ready
        finally:
            self._device_staging.release(buffer)
