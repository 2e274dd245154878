"""kvtransfer's `rdt` transport (Ray Direct Transport over gloo) between real Ray actors in one
collective group, on a local 127.0.0.1 cluster: the checks the `ray` transport passes, and the
rdt-specific ones."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch

# read when ray is imported: servers on 127.0.0.1
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
import ray  # noqa: E402

from engine.kv_cache import KVLayout  # noqa: E402
from kvtransfer.rdt_transport import (  # noqa: E402
    GLOO_INTERFACE_ENV,
    RdtKVDelivery,
    actor_class_options,
    device_checksum,
    form_group,
    interface_of,
)
from kvtransfer.wire import KVGroupHeader  # noqa: E402
from tests.kv_ends import (  # noqa: E402
    FP32,
    LAYER_GROUPS,
    TOTAL_BLOCKS,
    KVEndWorker,
    assert_within_wire_bounds,
)

BF16 = KVLayout(num_layers=4, num_kv_heads=3, head_dim=64, block_size_tokens=16, dtype="bfloat16")
Worker = ray.remote(num_cpus=0.5, **actor_class_options())(KVEndWorker)


pytestmark = pytest.mark.own_ray_cluster  # shuts the session's shared cluster down: runs first


@pytest.fixture(scope="module")
def local_ray():
    # the session's shared cluster (tests/conftest.py), if it is up: this module sizes its own
    ray.shutdown()
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        object_store_memory=256 << 20,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


class Pair:
    """A sender actor and a receiver actor of one layout in one gloo group; the driver routes
    deliveries."""

    def __init__(self, layout: KVLayout):
        self.layout = layout
        self.prefill = Worker.remote(layout, TOTAL_BLOCKS, "rdt", "sender")
        self.decode = Worker.remote(layout, TOTAL_BLOCKS, "rdt", "receiver", get_timeout_s=20.0)
        self.group = form_group([self.prefill], [self.decode], backend="gloo")

    def send(self, request_id: str, layers: slice) -> RdtKVDelivery:
        return ray.get(
            self.prefill.send.remote(
                request_id, layers.start or 0, layers.stop or self.layout.num_layers
            )
        )

    def deliver(self, delivery):
        return ray.get(self.decode.deliver.remote(delivery))

    def assert_all_free(self) -> None:
        for free, total in ray.get(
            [
                self.prefill.free_and_total_blocks.remote(),
                self.decode.free_and_total_blocks.remote(),
            ]
        ):
            assert free == total, f"leaked {total - free} blocks"

    def close(self) -> None:
        for actor in (self.prefill, self.decode):
            try:
                ray.get(actor.close.remote(), timeout=10)
            except ray.exceptions.RayActorError:
                pass  # a test killed it
            ray.kill(actor)


@pytest.fixture(scope="module")
def pairs(local_ray):
    """One pair per layout for the module (a group takes a second or two to form); every test that
    uses one must leave all its blocks free."""
    made: dict[KVLayout, Pair] = {}

    def get(layout: KVLayout = FP32) -> Pair:
        if layout not in made:
            made[layout] = Pair(layout)
        return made[layout]

    yield get
    for pair in made.values():
        pair.close()


@pytest.fixture
def pair(pairs):
    used = pairs(FP32)
    yield used
    used.assert_all_free()


def _start(
    pair: Pair,
    request_id: str,
    num_blocks: int,
    seed: int = 0,
    timeout_s: float = 10.0,
    lease_s: float = 30.0,
):
    blocks = ray.get(pair.prefill.allocate_random.remote(num_blocks, seed))
    reserved = ray.get(pair.decode.reserve.remote(request_id, num_blocks, timeout_s))
    ray.get(pair.prefill.start.remote(request_id, blocks, None, lease_s))
    return blocks, reserved


@pytest.mark.parametrize("layout,num_blocks", [(FP32, 1), (FP32, 9), (BF16, 2), (BF16, 17)])
@pytest.mark.parametrize("mode", ["whole", "layerwise"])
def test_rdt_actors_round_trip_is_bit_identical(pairs, layout, num_blocks, mode):
    pair = pairs(layout)
    request_id = f"{mode}-{num_blocks}"
    blocks, reserved = _start(pair, request_id, num_blocks, seed=num_blocks)
    readiness = []
    for layers in LAYER_GROUPS[mode]:
        delivery = pair.send(request_id, layers)
        # no payload routed
        assert len(delivery.header) < 4096 and isinstance(delivery.sender, ray.actor.ActorHandle)
        readiness.append(pair.deliver(delivery))
    assert readiness[-1] is True and not any(readiness[:-1])  # ready only once the last group is in
    assert ray.get(pair.decode.wait_settled.remote(request_id, 10.0)) == ("ready", reserved)
    assert ray.get(pair.decode.digest.remote(reserved)) == ray.get(
        pair.prefill.digest.remote(blocks)
    )
    # the caller relays the ack (the router, in the system)
    ray.get(pair.prefill.acknowledge.remote(request_id))
    ray.get(pair.decode.free.remote(reserved))  # the decode worker owns them now
    pair.assert_all_free()


@pytest.mark.parametrize("wire", ["lossless", "fp8", "int8"])
def test_rdt_handoff_in_each_wire_mode(pairs, wire):
    pair = pairs(BF16)
    request_id = f"wire-{wire}"
    blocks = ray.get(pair.prefill.allocate_random.remote(4, 4, True))
    reserved = ray.get(pair.decode.reserve.remote(request_id, 4, 10.0))
    ray.get(pair.prefill.start.remote(request_id, blocks, None, 30.0, wire))
    readiness = [
        pair.deliver(pair.send(request_id, layers)) for layers in LAYER_GROUPS["layerwise"]
    ]
    assert readiness[-1] is True, readiness
    assert ray.get(pair.decode.wait_settled.remote(request_id, 10.0)) == ("ready", reserved)
    original, received = ray.get(
        [pair.prefill.blocks.remote(blocks), pair.decode.blocks.remote(reserved)]
    )
    assert_within_wire_bounds(original, received, wire)
    ray.get(pair.prefill.acknowledge.remote(request_id))
    ray.get(pair.decode.free.remote(reserved))
    pair.assert_all_free()


def _flip_staged_byte(worker, request_id: str, layer_start: int, index: int) -> None:
    """Corrupts a staged payload on the sender after its checksum was taken (as a bad link
    would)."""
    staged = worker.side._staged[(request_id, layer_start)]
    staged[index] ^= 0x10


def test_rdt_flipped_byte_is_caught_and_nothing_is_installed(pair):
    blocks, reserved = _start(pair, "corrupt", 3)
    before = ray.get(pair.decode.digest.remote(reserved))
    assert pair.deliver(pair.send("corrupt", slice(0, 2))) is False
    installed = ray.get(pair.decode.digest.remote(reserved))
    delivery = pair.send("corrupt", slice(2, None))
    ray.get(pair.prefill.__ray_call__.remote(_flip_staged_byte, "corrupt", 2, 123))
    name, message = pair.deliver(delivery)
    assert name == "ChecksumError" and "nothing installed" in message
    # layers 2.. untouched
    assert ray.get(pair.decode.digest.remote(reserved)) == installed != before
    name, _ = ray.get(pair.decode.wait_settled.remote("corrupt", 5.0))
    assert name == "ChecksumError"  # failed, never ready; its blocks are freed by that poll
    ray.get(pair.prefill.abort.remote("corrupt"))  # the caller relays the failure as an abort


def test_rdt_version_mismatch_at_first_message(pair):
    _start(pair, "v99", 2)
    delivery = pair.send("v99", slice(None))
    header = KVGroupHeader.decode(delivery.header, FP32)
    name, _ = pair.deliver(
        dataclasses.replace(delivery, header=dataclasses.replace(header, version=99).encode())
    )
    assert name == "WireVersionError"
    assert ray.get(pair.decode.wait_settled.remote("v99", 5.0))[0] == "WireVersionError"
    ray.get(pair.prefill.abort.remote("v99"))


def test_rdt_unacknowledged_lease_expires_and_silent_sender_reservation_expires(pair):
    _start(pair, "silent", 2, timeout_s=0.5, lease_s=0.5)
    # the rest never comes, nor an ack
    assert pair.deliver(pair.send("silent", slice(0, 1))) is False
    assert ray.get(pair.prefill.wait_settled.remote("silent", 5.0))[0] == "LeaseExpiredError"
    assert ray.get(pair.decode.wait_settled.remote("silent", 5.0))[0] == "ReservationExpiredError"


@pytest.mark.parametrize("aborting_side", ["sender", "receiver"])
def test_rdt_abort_from_either_side_frees_both(pair, aborting_side):
    _start(pair, "gone", 2)
    assert pair.deliver(pair.send("gone", slice(0, 1))) is False
    late = pair.send("gone", slice(1, None))  # staged, not pulled yet
    first, second = (
        (pair.prefill, pair.decode) if aborting_side == "sender" else (pair.decode, pair.prefill)
    )
    ray.get(first.abort.remote("gone"))
    ray.get(second.abort.remote("gone"))  # the caller relays an abort to the other side
    pair.assert_all_free()
    with pytest.raises(ray.exceptions.RayTaskError, match="KeyError"):
        pair.send("gone", slice(1, None))
    assert pair.deliver(late)[0] == "UnknownRequestError"  # rejected before anything is pulled


def test_rdt_pull_after_the_sender_aborted_fails_the_request(pair):
    _start(pair, "early", 2)
    delivery = pair.send("early", slice(None))
    ray.get(pair.prefill.abort.remote("early"))  # its staged payload goes with its blocks
    name, message = pair.deliver(delivery)
    assert name == "TransferAbortedError" and "not staged" in message
    assert ray.get(pair.decode.wait_settled.remote("early", 5.0))[0] == "TransferAbortedError"


def test_rdt_sender_dying_before_the_pull_fails_the_request_and_frees_the_reservation(local_ray):
    pair = Pair(BF16)
    try:
        _start(pair, "orphan", 8, timeout_s=10.0)
        assert pair.deliver(pair.send("orphan", slice(0, 1))) is False
        second = pair.send("orphan", slice(1, 2))
        ray.kill(pair.prefill, no_restart=True)  # dies with layers 1.. staged but not pulled
        with pytest.raises(ray.exceptions.RayActorError):
            # the kill is asynchronous: calls succeed until it lands
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                ray.get(pair.prefill.free_and_total_blocks.remote(), timeout=10)
                time.sleep(0.05)
        started = time.monotonic()
        name, message = pair.deliver(second)
        assert name == "TransferAbortedError" and "did not arrive" in message
        assert ray.get(pair.decode.wait_settled.remote("orphan", 10.0))[0] == "TransferAbortedError"
        assert time.monotonic() - started < 5.0  # at once, not at the reservation's timeout
        free, total = ray.get(pair.decode.free_and_total_blocks.remote())
        assert free == total  # and the decode actor lives on
    finally:
        pair.close()


def test_device_checksum_is_the_weighted_word_sum_and_catches_a_flipped_bit():
    payload = torch.randint(
        0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5)
    )
    words = payload.view(torch.int32).tolist()
    assert device_checksum(payload) == sum((2 * i + 1) * w for i, w in enumerate(words)) % (1 << 64)
    for index in (0, 1234, 4095):
        flipped = payload.clone()
        flipped[index] ^= 0x01
        assert device_checksum(flipped) != device_checksum(payload)
    swapped = payload.view(torch.int32).clone()
    swapped[[3, 700]] = swapped[[700, 3]]
    assert swapped[3] != swapped[700] and device_checksum(
        swapped.view(torch.uint8)
    ) != device_checksum(payload)


def test_a_tensor_payload_verified_by_the_device_checksum_installs_bit_identical_or_not_at_all():
    """What the device branch of `RdtKVReceiver.install_payload` does, on CPU tensors: the payload
    stays a tensor (no host bytes view) and its checksum is `device_checksum`."""
    from kvtransfer.errors import ChecksumError
    from kvtransfer.rdt_transport import RdtKVReceiver
    from tests.kv_ends import KVEnd

    sender_end, receiver_end = KVEnd.make(FP32, 8), KVEnd.make(FP32, 8)
    blocks = sender_end.allocator.allocate(3)
    sender_end.fill_random(blocks, seed=9)
    payload = sender_end.blocks_bytes(blocks).reshape(-1).clone()
    receiver = RdtKVReceiver(receiver_end.cache, receiver_end.allocator)
    for request_id, corrupt in (("bad", True), ("good", False)):
        reserved = receiver.reserve(request_id, 3, timeout_s=5.0)
        header = KVGroupHeader(
            request_id,
            "prefill-0",
            1,
            FP32,
            0,
            FP32.num_layers,
            3,
            payload.numel(),
            device_checksum(payload),
        )
        received = payload.clone()
        if corrupt:
            received[77] ^= 0x04
            with pytest.raises(ChecksumError, match="nothing installed"):
                receiver.install(header, received, payload_checksum=device_checksum(received))
            assert not torch.equal(receiver_end.blocks_bytes(reserved).reshape(-1), payload)
        else:
            assert (
                receiver.install(header, received, payload_checksum=device_checksum(received))
                is True
            )
            assert torch.equal(receiver_end.blocks_bytes(reserved).reshape(-1), payload)
    events = receiver.poll()
    assert set(events.ready) == {"good"} and isinstance(dict(events.failed)["bad"], ChecksumError)
    receiver_end.allocator.free(events.ready["good"])
    assert receiver_end.all_free


def _gloo_interface(_actor):
    return os.environ.get(GLOO_INTERFACE_ENV)


def test_rdt_members_run_gloo_on_the_interface_of_their_node_address(pair):
    """Gloo's own choice is the address the hostname resolves to (127.0.0.1 in many /etc/hosts),
    which no other host reaches: each member is pinned to the interface holding its Ray node
    address before the group forms (tests/test_two_hosts.py crosses a real link)."""
    assert interface_of("127.0.0.1") == "lo" and interface_of("192.0.2.255") is None
    members = (pair.prefill, pair.decode)
    assert ray.get([m.__ray_call__.remote(_gloo_interface) for m in members]) == ["lo", "lo"]
