"""The `rdt` transport: layer groups move actor to actor through Ray Direct Transport, not the
object store.

What Ray 2.60 offers (alpha), and what this uses
    An actor task called with `tensor_transport=` ("gloo" for CPU tensors, "nccl" for CUDA ones,
    both two-sided collectives; "nixl", one-sided) leaves the tensors it returns in that actor; they
    move only when the ObjectRef is passed, as a direct argument, to a task of another actor. For
    gloo and nccl:
    (a) both actors must be members of one collective group (`ray.experimental.collective`), formed
    before any transfer; each actor is in at most one group per backend, and a gloo group's members
    are fixed for the life of their processes (torch.distributed's default group is set up once per
    process);
    (b) Ray keeps the group's handle per process: only a process that holds it can submit such
        tasks;
    (c) `ray.get` of such a ref is refused; (d) a system-level failure during a transfer (an actor
        dying,
    the 60 s fetch timeout) makes Ray kill both actors and destroy the group; (e) the actor classes
    need `enable_tensor_transport=True`, which gives each a one-thread `_ray_system` concurrency
    group where Ray runs its send and receive tasks. Ray's docs leave asyncio actors (both our
    workers) out of RDT; the one-transfer rule below is what makes them safe here. (f) Gloo listens
    on, and tells its peers, the address the machine's hostname resolves to, often 127.0.0.1: each
    member is pinned to the interface holding its Ray node address first (`GLOO_SOCKET_IFNAME`),
    or a group spanning hosts never forms.

How a handoff moves (nothing travels through the object store but the small routed message)
    The sender (prefill worker) copies a layer group into a staging buffer on the cache's device,
    checksums it and keeps it; only `RdtKVDelivery` (the encoded `KVGroupHeader`, the sender actor's
    handle and the sender's key) is routed, as for `ray`, by the caller to the receiver's `deliver`
    (in serving: the prefill worker, straight to the decode worker). The
    receiver (decode worker) pulls: it calls the sender actor for the staged tensor with
    `tensor_transport=backend` (so this process owns the ref), passes that ref to an install task on
    its own actor, and Ray moves the bytes sender -> receiver over the group. The install task
    verifies the checksum and writes the group into the reserved blocks; `deliver` returns its
    answer. So the decode workers submit the RDT tasks: `form_group` (the driver, once at start,
    over every worker) registers the group in each of them (b). Both ends run these tasks in their
    `pdserve_kv` concurrency group, away from the actor's own calls. One transfer at a time per
    receiver: a two-sided send and its receive pair up in order on each actor's one RDT thread; with
    at most one receive outstanding per decode worker, the send at the head of every prefill
    worker's queue always has its receive posted, so transfers can never wait on each other in a
    cycle.

Integrity
    CPU (gloo): the XXH3-64 checksum of every transport, computed by the sender at export, verified
    by the install task before anything is written. Device memory (nccl): XXH3 runs on the host, and
    hashing there would copy every byte off the device, the copy RDT exists to avoid. The header's
    checksum is then `device_checksum`, computed on the device at both ends: the sum of (2i+1) *
    word_i over the payload's signed 32-bit words, mod 2^64 (an odd weight is invertible mod 2^64,
    so any one corrupted word changes it). A device payload is verified with it before install,
    exactly as a CPU one.

Ownership and failure
    Staged buffers are the sender's until ack, abort or lease expiry (RDT holds a reference, not a
    copy); each group can be pulled once. A pull that finds nothing (aborted, expired, pulled) or a
    sender that died before the pull fails the request (freed at the receiver's next `poll`). A
    sender dying *during* a transfer is (d): Ray kills the decode worker too, and the router fails
    its requests over as for any worker death. Acks and aborts travel through the caller, as for
    `ray`.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import ray
import torch

from kvtransfer.base import DEFAULT_LEASE_S, KVReceiver, KVSender
from kvtransfer.buffers import BufferPool
from kvtransfer.errors import KVTransferError, TransferAbortedError, WireFormatError
from kvtransfer.leases import HeldRequest
from kvtransfer.wire import KVGroupHeader, as_bytes_view, checksum

CONCURRENCY_GROUP = "pdserve_kv"
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}  # by the KV cache's device
# Gloo's interface, read when a process's group forms. Unset, gloo listens on and advertises the
# address this machine's hostname resolves to: 127.0.0.1 where /etc/hosts says so, which a member
# on another host cannot reach ("Gloo connectFullMesh failed ... remote=[127.0.0.1]").
GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915
# bounds the int64 temporaries of `device_checksum` (128 MiB each)
_DEVICE_CHECKSUM_CHUNK_WORDS = 1 << 24


def actor_class_options() -> dict:
    """What an actor class holding either end needs: `ray.remote(**actor_class_options())(Worker)`
    (Ray reads both at class creation, not from `.options()`)."""
    return {"enable_tensor_transport": True, "concurrency_groups": {CONCURRENCY_GROUP: 1}}


def form_group(
    senders: Sequence, receivers: Sequence, backend: str = "gloo", name: Optional[str] = None
) -> str:
    """Once, before any handoff: one collective group over every sender and receiver actor,
    registered in each receiver's process, where transfers are submitted. Blocks until every member
    joined."""
    from ray.experimental.collective import create_collective_group

    members = [*senders, *receivers]
    if backend == "gloo":
        ray.get([member.__ray_call__.remote(_gloo_on_node_interface) for member in members])
    group = create_collective_group(
        members, backend=backend, name=name or f"pdserve-kv-{uuid.uuid4().hex[:12]}"
    )
    ray.get([receiver.__ray_call__.remote(_register_group, group) for receiver in receivers])
    return group.name


def _gloo_on_node_interface(_actor) -> Optional[str]:
    """On a member, before its group forms: gloo on the interface that holds this node's Ray
    address (which every other node reaches it by), unless the user chose one. Returns it."""
    if GLOO_INTERFACE_ENV not in os.environ:
        interface = interface_of(ray.util.get_node_ip_address())
        if interface is not None:
            os.environ[GLOO_INTERFACE_ENV] = interface
    return os.environ.get(GLOO_INTERFACE_ENV)


def interface_of(address: str) -> Optional[str]:
    """The network interface whose (primary) IPv4 address is `address`; None if none is."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(
                    probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15])
                )
            except OSError:  # no IPv4 address
                continue
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def _register_group(_actor, group) -> None:
    from ray.experimental.collective.collective import RemoteCommunicatorManager

    RemoteCommunicatorManager.get().add_remote_communicator(group)


def device_checksum(payload: torch.Tensor) -> int:
    """sum((2i + 1) * word_i) mod 2^64 over the signed 32-bit words of a flat uint8 tensor, computed
    where it lives (int64 arithmetic wraps mod 2^64)."""
    words = payload.view(torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=payload.device)
    for start in range(0, words.numel(), _DEVICE_CHECKSUM_CHUNK_WORDS):
        chunk = words[start : start + _DEVICE_CHECKSUM_CHUNK_WORDS].to(torch.int64)
        weights = torch.arange(
            2 * start + 1, 2 * (start + chunk.numel()), 2, dtype=torch.int64, device=payload.device
        )
        total += (chunk * weights).sum()
    return int(total) % (1 << 64)


def _checksum(payload: torch.Tensor) -> int:
    return (
        checksum(as_bytes_view(payload))
        if payload.device.type == "cpu"
        else device_checksum(payload)
    )


# RDT tasks run on an actor as closures (`__ray_call__`), which receive the actor instance, not our
# transport ends: they find the ends of their process here, by key. Weak: a dropped end disappears.
_LOCAL_ENDS: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()


def _local_end(key: str, request_id: str):
    end = _LOCAL_ENDS.get(key)
    if end is None:
        raise TransferAbortedError(
            f"rdt transport end {key!r} is gone from its worker (closed?)", request_id
        )
    return end


def _staged_payload(_actor, sender_key: str, request_id: str, layer_start: int) -> torch.Tensor:
    """On the sender's actor: the staged group; Ray keeps it there and sends it to whoever gets the
    ref."""
    return _local_end(sender_key, request_id).take_staged(request_id, layer_start)


def _install_payload(_actor, receiver_key: str, header: bytes, payload: torch.Tensor) -> bool:
    """On the receiver's actor, once Ray received the payload: verify it and write it into the
    blocks."""
    receiver = _local_end(receiver_key, None)
    return receiver.install_payload(KVGroupHeader.decode(header, receiver.layout), payload)


def _current_actor():
    try:
        return ray.get_runtime_context().current_actor
    except RuntimeError as error:
        raise RuntimeError("both ends of the rdt transport live in Ray actors") from error


@dataclass(frozen=True)
class RdtKVDelivery:
    """One layer group ready to be pulled: its encoded header, and where its payload waits."""

    header: bytes
    sender: Any  # the sender's ActorHandle
    sender_key: str


class RdtKVSender(KVSender):
    def __init__(self, cache, allocator, sender_id: str, epoch: int):
        super().__init__(cache, allocator, sender_id, epoch)
        self._staging = BufferPool(device=cache.kv.device)
        self.key = f"rdt-sender-{uuid.uuid4().hex}"
        self._staged_lock = threading.Lock()  # the owner's thread stages, pull tasks take
        # (request id, layer start) -> payload
        self._staged: dict[tuple[str, int], torch.Tensor] = {}
        self._actor = None
        _LOCAL_ENDS[self.key] = self

    def start(
        self,
        request_id: str,
        block_ids: Sequence[int],
        destination: Optional[str] = None,
        lease_s: float = DEFAULT_LEASE_S,
        wire: str = "none",
    ) -> None:
        # its staging buffers
        self._hold(request_id, block_ids, lease_s, wire).transport_state = []

    def _usable_wire(self, wire: str) -> str:
        # a group staged on a GPU leaves from there (nccl): lossless would need the host
        return "none" if wire == "lossless" and self.cache.kv.device.type != "cpu" else wire

    def send_layers(self, request_id: str, layers: slice = slice(None)) -> RdtKVDelivery:
        held = self.ledger.get(request_id)
        header, data, buffer = self._export(held, layers)
        held.transport_state.append(buffer)  # back to the pool with the blocks
        with self._staged_lock:  # the buffer's head, or the group's encoding
            self._staged[(request_id, header.layer_start)] = data.reshape(-1).view(torch.uint8)
        if self._actor is None:
            self._actor = _current_actor()
        return RdtKVDelivery(header.encode(), self._actor, self.key)

    def _checksum(self, data: torch.Tensor) -> int:
        return _checksum(data.reshape(-1).view(torch.uint8))

    def take_staged(self, request_id: str, layer_start: int) -> torch.Tensor:
        """Any thread (a pull task's): the staged payload, once."""
        with self._staged_lock:
            payload = self._staged.pop((request_id, layer_start), None)
        if payload is None:
            raise TransferAbortedError(
                f"KV of request {request_id!r}, layers from {layer_start}, is not staged on this "
                "sender (acknowledged, aborted, lease expired, or already pulled)",
                request_id,
            )
        return payload

    def _drop(self, held: Optional[HeldRequest], aborted: bool) -> None:
        if held is None:
            return
        with self._staged_lock:
            for key in [key for key in self._staged if key[0] == held.request_id]:
                del self._staged[key]
        # a pull still reading one after an abort fails its checksum
        for buffer in held.transport_state:
            self._staging.release(buffer)
        held.transport_state = []

    def close(self) -> None:
        super().close()
        _LOCAL_ENDS.pop(self.key, None)


class RdtKVReceiver(KVReceiver):
    def __init__(
        self,
        cache,
        allocator,
        backend: Optional[str] = None,
        get_timeout_s: float = DEFAULT_LEASE_S,
    ):
        super().__init__(cache, allocator)
        self.backend = backend or BACKENDS[cache.kv.device.type]
        self.get_timeout_s = get_timeout_s
        self.key = f"rdt-receiver-{uuid.uuid4().hex}"
        # see the module docstring: no cycle of waiting transfers
        self._one_transfer = threading.Lock()
        _LOCAL_ENDS[self.key] = self

    def deliver(self, delivery: RdtKVDelivery) -> bool:
        """Pull and install one routed layer group; True once the request has all its layers. Raises
        a `KVTransferError` (and fails the request, freed at the next `poll`) on any problem."""
        return self._install_routed(delivery.header, lambda header: self._pull(delivery, header))

    def _pull(self, delivery: RdtKVDelivery, header: KVGroupHeader) -> bool:
        me = _current_actor()
        with self._one_transfer:
            payload = delivery.sender.__ray_call__.options(
                tensor_transport=self.backend, concurrency_group=CONCURRENCY_GROUP
            ).remote(_staged_payload, delivery.sender_key, header.request_id, header.layer_start)
            installed = me.__ray_call__.options(concurrency_group=CONCURRENCY_GROUP).remote(
                _install_payload, self.key, delivery.header, payload
            )
            del payload  # the install task holds the ref; the sender's copy is dropped once it ran
            try:
                return ray.get(installed, timeout=self.get_timeout_s)
            except ray.exceptions.RayTaskError as error:
                if isinstance(error.cause, KVTransferError):
                    raise error.cause from None
                raise self._unreachable(header, error) from error
            except (ray.exceptions.RayError, TimeoutError) as error:
                raise self._unreachable(header, error) from error

    @staticmethod
    def _unreachable(header: KVGroupHeader, error: Exception) -> TransferAbortedError:
        return TransferAbortedError(
            f"KV payload of request {header.request_id!r}, layers [{header.layer_start}, "
            f"{header.layer_stop}), did not arrive (sender gone?): {type(error).__name__}: {error}",
            header.request_id,
        )

    def install_payload(self, header: KVGroupHeader, payload: torch.Tensor) -> bool:
        """In the install task: check and write one received group (see `Reservations.install`)."""
        if (
            payload.dtype != torch.uint8
            or payload.dim() != 1
            or payload.numel() != header.payload_bytes
        ):
            raise WireFormatError(
                f"KV payload of request {header.request_id!r}: {payload.dtype} "
                f"{tuple(payload.shape)} received, {header.payload_bytes} bytes (uint8) expected",
                header.request_id,
            )
        if payload.device.type == "cpu":
            return self.install(header, as_bytes_view(payload))
        return self.install(header, payload, payload_checksum=device_checksum(payload))

    def close(self) -> None:
        super().close()
        _LOCAL_ENDS.pop(self.key, None)
