"""The `ray` transport's same-GPU path (kvtransfer/cuda_ipc.py) on CPU: the two CUDA IPC calls
(share a device buffer, open it in another process) are replaced by a registry in this process, and
the device is given a UUID; everything else (device staging, device checksum, the delivery, the UUID
check, the copy and install, buffers held until ack) runs as it does on a GPU. The IPC calls
themselves run only on a GPU: scripts/gpu_serve_check.py's `8b_ipc` section."""

import pytest
import torch

from kvtransfer import ChecksumError, TransferAbortedError, create_receiver, create_sender, cuda_ipc
from tests.kv_ends import FP32, LAYER_GROUPS, TOTAL_BLOCKS, KVEnd


@pytest.fixture
def shared_on_one_device(monkeypatch):
    """CPU tensors stand for one GPU's memory: `share` registers a buffer, `open_shared` returns
    it."""
    shared: dict[int, torch.Tensor] = {}

    def share(buffer):
        shared[id(buffer)] = buffer
        return (id(buffer),)

    monkeypatch.setenv(cuda_ipc.ENV, "1")
    monkeypatch.setattr(cuda_ipc, "enabled", lambda device: True)
    monkeypatch.setattr(cuda_ipc, "device_uuid", lambda device: "GPU-test")
    monkeypatch.setattr(cuda_ipc, "share", share)
    monkeypatch.setattr(cuda_ipc, "open_shared", lambda handle, device: shared[handle[0]])
    return shared


def _pair():
    sender_end, receiver_end = KVEnd.make(FP32, TOTAL_BLOCKS), KVEnd.make(FP32, TOTAL_BLOCKS)
    sender = create_sender("ray", sender_end.cache, sender_end.allocator, "prefill-test", 1)
    receiver = create_receiver("ray", receiver_end.cache, receiver_end.allocator)
    return sender_end, receiver_end, sender, receiver


def _start(sender_end, sender, receiver, request_id: str, num_blocks: int = 5):
    blocks = sender_end.allocator.allocate(num_blocks)
    sender_end.fill_random(blocks, seed=num_blocks)
    reserved = receiver.reserve(request_id, num_blocks, timeout_s=30)
    sender.start(request_id, blocks, None, lease_s=30)
    return blocks, reserved


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
    assert sender._staging._free == []  # held by the request until the ack
    sender.acknowledge("r1")
    assert len(sender._staging._free) == len(LAYER_GROUPS[groups])  # back for the next one
    receiver_end.allocator.free(reserved)
    assert sender_end.all_free and receiver_end.all_free


def test_a_receiver_on_another_gpu_fails_at_the_first_message(shared_on_one_device, monkeypatch):
    sender_end, receiver_end, sender, receiver = _pair()
    _start(sender_end, sender, receiver, "r2")
    delivery = sender.send_layers("r2")
    monkeypatch.setattr(cuda_ipc, "device_uuid", lambda device: "GPU-other")
    with pytest.raises(TransferAbortedError, match="GPU-test.*GPU-other.*one GPU"):
        receiver.deliver(delivery)
    assert "r2" in dict(receiver.poll().failed)
    sender.abort("r2")
    assert sender_end.all_free and receiver_end.all_free


def test_a_buffer_changed_after_sending_is_caught_by_the_checksum(shared_on_one_device):
    sender_end, receiver_end, sender, receiver = _pair()
    _start(sender_end, sender, receiver, "r3")
    delivery = sender.send_layers("r3")
    shared_on_one_device[delivery.handle[0]][7] ^= 0xFF  # a sender reusing it after an abort
    with pytest.raises(ChecksumError):
        receiver.deliver(delivery)
    assert "r3" in dict(receiver.poll().failed)
    sender.abort("r3")
    assert sender_end.all_free and receiver_end.all_free


def test_off_unless_asked_for(monkeypatch):
    monkeypatch.delenv(cuda_ipc.ENV, raising=False)
    assert not cuda_ipc.enabled(torch.device("cpu"))
    monkeypatch.setenv(cuda_ipc.ENV, "1")
    assert not cuda_ipc.enabled(torch.device("cpu"))  # a cache on the host: host staging
