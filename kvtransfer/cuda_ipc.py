"""A same-GPU handoff for the `ray` transport: the KV never leaves the device (issue #32).

When a prefill and a decode worker share one GPU (fractional GPUs, or a serving check on one card),
host staging copies every byte device -> pinned host -> object store -> device, at most ~27 GB/s on
an H200, where CUDA IPC between two processes measured 196-895 GB/s. A `ray` receiver whose cache is
on a GPU advertises `cuda:<its GPU's UUID>` as its address (the router passes a decode worker's
address to the prefill worker with each prompt); a sender whose cache is on that same GPU then, for
that request:
  - gathers each layer group into a buffer on its device (a reused pool, like the host one), takes
    `device_checksum` of it there (the rdt transport's integrity rule for device memory), waits for
    the gather, and keeps the buffer until ack, abort or lease expiry (the contract of every
    sender);
  - routes a `CudaIpcKVDelivery`: the encoded header, the CUDA IPC handle of the buffer as plain
    Python values (it travels between the workers in a Ray call), and its GPU's UUID.
The receiver opens the handle only if its own cache is on the GPU of that UUID, copies the group
into a buffer of its own, verifies the checksum on that copy (so a buffer a sender reused after an
abort is caught, never installed) and installs it. A delivery it cannot use (from another GPU than
its own, or a handle that does not open: the sender gone, no shared IPC namespace) fails the
request at once with an error that says why.

A request bound for another GPU, another node or a CPU cache is host-staged as before.
`PDSERVE_KV_CUDA_IPC=0` in the workers' environment turns the device path off (every request
host-staged). Tested on CPU with the IPC calls replaced (tests/test_kv_cuda_ipc.py); on an H200 by
scripts/gpu_serve_check.py (its `8b_ipc` section against `8b`'s host staging).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

ENV = "PDSERVE_KV_CUDA_IPC"  # "0": off
ADDRESS_PREFIX = "cuda:"


@dataclass(frozen=True)
class CudaIpcKVDelivery:
    """One layer group shared in device memory: the encoded `KVGroupHeader`, `share`'s handle and
    the UUID of the GPU holding it. Plain values only: it travels in a Ray call (prefill ->
    decode)."""

    header: bytes
    handle: tuple
    device_uuid: str


def device_uuid(device: torch.device) -> Optional[str]:
    """The GPU's UUID (one card seen from two processes, whatever their CUDA_VISIBLE_DEVICES
    say)."""
    if device.type != "cuda":
        return None
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return None if uuid is None else str(uuid)


def enabled(device: torch.device) -> bool:
    """CUDA IPC for a cache on a GPU whose UUID is known, unless turned off."""
    return os.environ.get(ENV) != "0" and device.type == "cuda" and device_uuid(device) is not None


def address(device: torch.device) -> Optional[str]:
    """A receiver's address for senders on its GPU (`cuda:<UUID>`); None where it has none."""
    return f"{ADDRESS_PREFIX}{device_uuid(device)}" if enabled(device) else None


def share(buffer: torch.Tensor) -> tuple:
    """The CUDA IPC handle of a flat uint8 device tensor (torch's own reduction), torch-free."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buffer)
    (_, size, stride, offset, _, _, _, handle, storage_bytes, storage_offset, _) = args[:11]
    ref_counter_handle, ref_counter_offset, event_handle, event_sync = args[11:15]
    return (
        tuple(size),
        tuple(stride),
        offset,
        handle,
        storage_bytes,
        storage_offset,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync,
    )


def open_shared(handle: tuple, device: torch.device) -> torch.Tensor:
    """The sender's buffer, mapped into this process (on `device`, the same GPU: UUIDs checked)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    size, stride, offset, ipc_handle, storage_bytes, storage_offset, *rest = handle
    with torch.cuda.device(device):
        return rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size(size),
            stride,
            offset,
            torch.storage.TypedStorage,
            torch.uint8,
            device.index or 0,
            ipc_handle,
            storage_bytes,
            storage_offset,
            False,
            *rest,
        )
