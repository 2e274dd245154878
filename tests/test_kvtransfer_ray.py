"""kvtransfer's `ray` transport, and both transports between real Ray actors, on a local 127.0.0.1
cluster."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch

# Read when ray is imported: with it, Ray 2.60 binds all its servers to 127.0.0.1 (checked with ss
# -ltnp).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
import ray  # noqa: E402

from engine.kv_cache import KVLayout  # noqa: E402
from kvtransfer import (  # noqa: E402
    ChecksumError,
    LeaseExpiredError,
    ReservationExpiredError,
    UnknownRequestError,
    WireVersionError,
    create_receiver,
    create_sender,
)
from kvtransfer.ray_transport import RayKVDelivery  # noqa: E402
from kvtransfer.wire import KVGroupHeader  # noqa: E402
from tests.kv_ends import (  # noqa: E402
    FP32,
    LAYER_GROUPS,
    TOTAL_BLOCKS,
    KVEnd,
    KVEndWorker,
    assert_within_wire_bounds,
    one_fake_gpu,
)

BF16 = KVLayout(num_layers=4, num_kv_heads=3, head_dim=64, block_size_tokens=16, dtype="bfloat16")


pytestmark = pytest.mark.own_ray_cluster  # shuts the session's shared cluster down: runs first


@pytest.fixture(scope="module")
def local_ray():
    # the session's shared cluster (tests/conftest.py), if it is up: this module sizes its own
    ray.shutdown()
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=512 << 20,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture
def ray_pair(local_ray):
    """A ray sender and receiver in this process; both ends must end with every block free."""
    sender_end, receiver_end = KVEnd.make(FP32, TOTAL_BLOCKS), KVEnd.make(FP32, TOTAL_BLOCKS)
    pairs = []

    def make(layout: KVLayout = FP32):
        nonlocal sender_end, receiver_end
        sender_end, receiver_end = (
            KVEnd.make(layout, TOTAL_BLOCKS),
            KVEnd.make(layout, TOTAL_BLOCKS),
        )
        sender = create_sender("ray", sender_end.cache, sender_end.allocator, "prefill-0", 7)
        receiver = create_receiver(
            "ray", receiver_end.cache, receiver_end.allocator, get_timeout_s=5.0
        )
        pairs.append((sender_end, receiver_end))
        return sender, receiver, sender_end, receiver_end

    yield make
    for ends in pairs:
        for end in ends:
            assert end.all_free, (
                f"leaked {end.allocator.num_blocks - end.allocator.num_free_blocks} blocks"
            )


@pytest.mark.parametrize("layout,num_blocks", [(FP32, 1), (FP32, 9), (BF16, 2), (BF16, 17)])
@pytest.mark.parametrize("mode", ["whole", "layerwise"])
def test_ray_round_trip_is_bit_identical(ray_pair, layout, num_blocks, mode):
    sender, receiver, sender_end, receiver_end = ray_pair(layout)
    blocks = sender_end.allocator.allocate(num_blocks)
    sender_end.fill_random(blocks, seed=num_blocks)
    reserved = receiver.reserve("r", num_blocks, timeout_s=5.0)
    sender.start("r", blocks)
    readiness = [receiver.deliver(sender.send_layers("r", layers)) for layers in LAYER_GROUPS[mode]]
    assert readiness[-1] and not any(readiness[:-1])  # ready only once the last group is in
    assert receiver.poll().ready == {"r": reserved}
    assert torch.equal(receiver_end.blocks_bytes(reserved), sender_end.blocks_bytes(blocks))
    sender.acknowledge("r")  # the caller relays the ack (the decode worker, in the system)
    receiver_end.allocator.free(reserved)


@pytest.mark.parametrize("wire", ["lossless", "fp8", "int8"])
def test_ray_handoff_in_each_wire_mode(ray_pair, wire):
    sender, receiver, sender_end, receiver_end = ray_pair(BF16)
    blocks = sender_end.allocator.allocate(5)
    sender_end.fill_normal(blocks, seed=5)
    reserved = receiver.reserve("r", 5, timeout_s=5.0)
    sender.start("r", blocks, wire=wire)
    for layers in LAYER_GROUPS["layerwise"]:
        receiver.deliver(sender.send_layers("r", layers))
    assert sender.wire_sent("r")[0] == wire
    assert receiver.poll().ready == {"r": reserved}
    expected = sender_end.cache.export_blocks(blocks)
    assert_within_wire_bounds(expected, receiver_end.cache.export_blocks(reserved), wire)
    sender.acknowledge("r")
    receiver_end.allocator.free(reserved)


def test_ray_flipped_byte_is_caught(ray_pair):
    sender, receiver, sender_end, receiver_end = ray_pair()
    blocks = sender_end.allocator.allocate(3)
    sender_end.fill_random(blocks)
    receiver.reserve("r", 3, timeout_s=5.0)
    sender.start("r", blocks)
    assert receiver.deliver(sender.send_layers("r", slice(0, 2))) is False
    good = sender.send_layers("r", slice(2, None))
    corrupted = ray.get(good.payload).copy()
    corrupted[123] ^= 0x10
    with pytest.raises(ChecksumError, match="nothing installed"):
        receiver.deliver(RayKVDelivery(good.header, ray.put(corrupted)))
    events = receiver.poll()
    assert events.ready == {} and isinstance(dict(events.failed)["r"], ChecksumError)
    sender.abort("r")


def test_ray_version_mismatch_at_first_message(ray_pair):
    sender, receiver, sender_end, _ = ray_pair()
    blocks = sender_end.allocator.allocate(2)
    receiver.reserve("r", 2, timeout_s=5.0)
    sender.start("r", blocks)
    delivery = sender.send_layers("r")
    header = KVGroupHeader.decode(delivery.header, FP32)
    with pytest.raises(WireVersionError):
        receiver.deliver(
            RayKVDelivery(dataclasses.replace(header, version=99).encode(), delivery.payload)
        )
    assert isinstance(dict(receiver.poll().failed)["r"], WireVersionError)
    sender.abort("r")


def test_ray_unacknowledged_lease_expires_and_silent_sender_reservation_expires(ray_pair):
    sender, receiver, sender_end, _ = ray_pair()
    blocks = sender_end.allocator.allocate(2)
    receiver.reserve("r", 2, timeout_s=0.3)
    sender.start("r", blocks, lease_s=0.3)
    # the rest never comes, no ack ever comes
    receiver.deliver(sender.send_layers("r", slice(0, 1)))
    assert sender.poll().failed == () and receiver.poll().failed == ()
    time.sleep(0.35)
    assert isinstance(dict(sender.poll().failed)["r"], LeaseExpiredError)
    assert isinstance(dict(receiver.poll().failed)["r"], ReservationExpiredError)


@pytest.mark.parametrize("aborting_side", ["sender", "receiver"])
def test_ray_abort_from_either_side_frees_both(ray_pair, aborting_side):
    sender, receiver, sender_end, receiver_end = ray_pair()
    blocks = sender_end.allocator.allocate(2)
    receiver.reserve("r", 2, timeout_s=5.0)
    sender.start("r", blocks)
    receiver.deliver(sender.send_layers("r", slice(0, 1)))
    first, second = (sender, receiver) if aborting_side == "sender" else (receiver, sender)
    first.abort("r")
    second.abort("r")  # the caller (the router, in the system) relays an abort to the other side
    assert sender_end.all_free and receiver_end.all_free
    with pytest.raises(KeyError):
        sender.send_layers("r", slice(1, None))
    late = RayKVDelivery(
        KVGroupHeader(
            "r", "prefill-0", 7, FP32, 1, 4, 2, 3 * 2 * FP32.bytes_per_block_per_layer, 0
        ).encode(),
        ray.put(b"x"),
    )
    with pytest.raises(UnknownRequestError):
        receiver.deliver(late)


# --- two real actors -----------------------------------------------------------------------------

Worker = ray.remote(num_cpus=1)(KVEndWorker) if ray else None


def assert_all_free(*actors):
    for free, total in ray.get([actor.free_and_total_blocks.remote() for actor in actors]):
        assert free == total


@pytest.mark.parametrize("transport", ["ray", "grpc"])
def test_actors_layerwise_round_trip_is_bit_identical(local_ray, transport):
    options = {"chunk_bytes": 1 << 20} if transport == "grpc" else {}
    prefill = Worker.remote(BF16, TOTAL_BLOCKS, transport, "sender", **options)
    decode = Worker.remote(BF16, TOTAL_BLOCKS, transport, "receiver")
    try:
        blocks = ray.get(prefill.allocate_random.remote(20, seed=3))
        reserved = ray.get(decode.reserve.remote("r", 20, 10.0))
        ray.get(prefill.start.remote("r", blocks, ray.get(decode.address.remote())))
        for layers in LAYER_GROUPS["layerwise"]:
            delivery = ray.get(
                prefill.send.remote("r", layers.start or 0, layers.stop or BF16.num_layers)
            )
            if transport == "ray":  # only the ObjectRef travels through here (the router's seat)
                assert isinstance(delivery.payload, ray.ObjectRef)
                ray.get(decode.deliver.remote(delivery))
        assert ray.get(decode.wait_settled.remote("r", 10.0)) == ("ready", reserved)
        if transport == "ray":
            ray.get(prefill.acknowledge.remote("r"))
        else:
            assert ray.get(prefill.wait_settled.remote("r", 10.0)) == ("acknowledged", None)
        assert ray.get(decode.digest.remote(reserved)) == ray.get(prefill.digest.remote(blocks))
        # the decode worker owns them now; the sender freed its own
        ray.get(decode.free.remote(reserved))
        assert_all_free(prefill, decode)
    finally:
        ray.get([prefill.close.remote(), decode.close.remote()])
        ray.kill(prefill), ray.kill(decode)


@pytest.mark.parametrize("transport", ["ray", "grpc"])
def test_actors_sender_dies_mid_transfer_frees_reservation(local_ray, transport):
    prefill = Worker.remote(BF16, TOTAL_BLOCKS, transport, "sender")
    decode = Worker.remote(BF16, TOTAL_BLOCKS, transport, "receiver")
    try:
        blocks = ray.get(prefill.allocate_random.remote(8))
        ray.get(decode.reserve.remote("r", 8, 3.0))
        ray.get(prefill.start.remote("r", blocks, ray.get(decode.address.remote())))
        first = ray.get(prefill.send.remote("r", 0, 1))
        second = ray.get(prefill.send.remote("r", 1, 2))
        if transport == "ray":
            assert ray.get(decode.deliver.remote(first)) is False
        ray.kill(prefill, no_restart=True)  # dies with layers 2.. unsent
        with pytest.raises(ray.exceptions.RayActorError):
            # the kill is asynchronous: calls succeed until it lands
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                ray.get(prefill.free_and_total_blocks.remote(), timeout=10)
                time.sleep(0.05)
        # a routed ref whose owner died: unreachable, or still in the local store
        if transport == "ray":
            outcome = ray.get(decode.deliver.remote(second))
            assert outcome is False or outcome[0] == "TransferAbortedError", outcome
        started = time.monotonic()
        name, message = ray.get(decode.wait_settled.remote("r", 10.0))
        assert name in ("TransferAbortedError", "ReservationExpiredError"), message
        assert time.monotonic() - started < 3.5  # within the reservation's timeout
        assert_all_free(decode)
    finally:
        ray.get(decode.close.remote())
        ray.kill(decode)


@pytest.mark.parametrize("destination", [None, "cuda:GPU-other", "127.0.0.1:5000"])
def test_ray_a_request_bound_off_the_senders_gpu_is_host_staged(ray_pair, monkeypatch, destination):
    """On one GPU the KV goes by CUDA IPC (tests/test_kv_cuda_ipc.py); bound for another GPU,
    another node or a receiver on the host, the object store carries it."""
    shared = one_fake_gpu(monkeypatch)
    sender, receiver, sender_end, receiver_end = ray_pair()
    assert receiver.address == "cuda:GPU-test"
    blocks = sender_end.allocator.allocate(3)
    sender_end.fill_random(blocks, seed=3)
    reserved = receiver.reserve("r", 3, timeout_s=30)
    sender.start("r", blocks, destination, lease_s=30)
    delivery = sender.send_layers("r")
    assert isinstance(delivery, RayKVDelivery) and not shared
    assert receiver.deliver(delivery)
    assert "r" in receiver.poll().ready
    assert torch.equal(sender_end.blocks_bytes(blocks), receiver_end.blocks_bytes(reserved))
    sender.acknowledge("r")
    receiver_end.allocator.free(reserved)
