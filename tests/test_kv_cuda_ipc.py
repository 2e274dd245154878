"""The `ray` transport's same-GPU path (kvtransfer/cuda_ipc.py) on CPU: the two CUDA IPC calls
(share a device buffer, open it in another process) are replaced by a registry in this process, and
the device is given a UUID; everything else (the choice by the receiver's address, device staging,
device checksum, the delivery, the UUID check, the copy and install, buffers held until ack) runs as
it does on a GPU. The IPC calls themselves run only on a GPU: scripts/gpu_serve_check.py's `8b_ipc`
section."""

from types import SimpleNamespace

import pytest
import torch

from kvtransfer import (
    ChecksumError,
    LeaseExpiredError,
    TransferAbortedError,
    create_receiver,
    create_sender,
    cuda_ipc,
)
from tests.kv_ends import FP32, LAYER_GROUPS, TOTAL_BLOCKS, KVEnd, one_fake_gpu


@pytest.fixture
def shared_on_one_device(monkeypatch):
    return one_fake_gpu(monkeypatch)


def _pair():
    sender_end, receiver_end = KVEnd.make(FP32, TOTAL_BLOCKS), KVEnd.make(FP32, TOTAL_BLOCKS)
    sender = create_sender("ray", sender_end.cache, sender_end.allocator, "prefill-test", 1)
    receiver = create_receiver("ray", receiver_end.cache, receiver_end.allocator)
    return sender_end, receiver_end, sender, receiver


def _start(
    sender_end, sender, receiver, request_id: str, num_blocks: int = 5, destination="", lease_s=30
):
    """`destination`: the receiver's own address unless given."""
    blocks = sender_end.allocator.allocate(num_blocks)
    sender_end.fill_random(blocks, seed=num_blocks)
    reserved = receiver.reserve(request_id, num_blocks, timeout_s=30)
    destination = receiver.address if destination == "" else destination
    sender.start(request_id, blocks, destination, lease_s=lease_s)
    return blocks, reserved


def _fails_at_once(request_id: str, break_delivery, error, match=None):
    """A first delivery `break_delivery` spoils: the receiver raises `error` and reports the request
    failed at once; after the sender's abort neither end holds a block."""
    sender_end, receiver_end, sender, receiver = _pair()
    _start(sender_end, sender, receiver, request_id)
    delivery = sender.send_layers(request_id)
    break_delivery(delivery)
    with pytest.raises(error, match=match):
        receiver.deliver(delivery)
    assert request_id in dict(receiver.poll().failed)
    sender.abort(request_id)
    assert sender_end.all_free and receiver_end.all_free


@pytest.mark.parametrize("groups", list(LAYER_GROUPS))
def test_same_device_handoff_is_bit_identical_and_frees_everything(shared_on_one_device, groups):
    sender_end, receiver_end, sender, receiver = _pair()
    blocks, reserved = _start(sender_end, sender, receiver, "r1")
    readies = []
    for layers in LAYER_GROUPS[groups]:
        delivery = sender.send_layers("r1", layers)
        assert isinstance(delivery, cuda_ipc.CudaIpcKVDelivery)
        assert delivery.device_uuid == "GPU-test"
        readies.append(receiver.deliver(delivery))
    assert readies[-1] and not any(readies[:-1])
    assert "r1" in receiver.poll().ready
    assert torch.equal(sender_end.blocks_bytes(blocks), receiver_end.blocks_bytes(reserved))
    assert sender._device_staging._free == []  # held by the request until the ack
    sender.acknowledge("r1")
    assert len(sender._device_staging._free) == len(LAYER_GROUPS[groups])  # back for the next one
    receiver_end.allocator.free(reserved)
    assert sender_end.all_free and receiver_end.all_free


def test_a_receiver_on_another_gpu_fails_at_the_first_message(shared_on_one_device, monkeypatch):
    def move_the_receiver(delivery):
        monkeypatch.setattr(cuda_ipc, "device_uuid", lambda device: "GPU-other")

    _fails_at_once("r2", move_the_receiver, TransferAbortedError, "GPU-test.*GPU-other.*one GPU")


def test_a_buffer_changed_after_sending_is_caught_by_the_checksum(shared_on_one_device):
    def reuse_the_buffer(delivery):  # as a sender reusing it after an abort
        shared_on_one_device[delivery.handle[0]][7] ^= 0xFF

    _fails_at_once("r3", reuse_the_buffer, ChecksumError)


def test_a_handle_that_does_not_open_fails_the_request_at_once(shared_on_one_device, monkeypatch):
    """The sender gone, no shared IPC namespace: torch raises; the request fails now, not when its
    reservation expires."""

    def cannot_open(handle, device):
        raise RuntimeError("CUDA error: invalid resource handle")

    def lose_the_sender(delivery):
        monkeypatch.setattr(cuda_ipc, "open_shared", cannot_open)

    _fails_at_once(
        "r5", lose_the_sender, TransferAbortedError, "could not be read.*invalid resource handle"
    )


def test_an_expired_lease_returns_the_shared_buffers(shared_on_one_device):
    sender_end, receiver_end, sender, receiver = _pair()
    _, reserved = _start(sender_end, sender, receiver, "r6", num_blocks=4, lease_s=0.0)
    sender.send_layers("r6")
    assert sender._device_staging._free == []
    (failed,) = sender.poll().failed  # expired: its blocks and its shared buffer come back
    assert failed[0] == "r6" and isinstance(failed[1], LeaseExpiredError) and sender_end.all_free
    assert len(sender._device_staging._free) == 1
    receiver.abort("r6")
    assert receiver_end.all_free and reserved


def test_on_for_a_gpu_cache_unless_turned_off(monkeypatch):
    monkeypatch.setattr(cuda_ipc, "device_uuid", lambda device: "GPU-test")
    gpu = SimpleNamespace(type="cuda")
    monkeypatch.delenv(cuda_ipc.ENV, raising=False)
    assert cuda_ipc.enabled(gpu) and cuda_ipc.address(gpu) == "cuda:GPU-test"
    assert cuda_ipc.address(SimpleNamespace(type="cpu")) is None  # a cache on the host
    monkeypatch.setenv(cuda_ipc.ENV, "0")
    assert not cuda_ipc.enabled(gpu) and cuda_ipc.address(gpu) is None
