"""kvtransfer without Ray: wire format, ledgers, and the grpc transport with both ends in this
process."""

from __future__ import annotations

import dataclasses
import time

import grpc
import msgpack
import pytest
import torch

from engine.kv_cache import KVLayout
from kvtransfer import (
    ChecksumError,
    KVGroupHeader,
    LayoutMismatchError,
    LeaseExpiredError,
    ReservationExpiredError,
    TransferAbortedError,
    WireFormatError,
    WireVersionError,
    create_receiver,
    create_sender,
)
from kvtransfer.grpc_transport import PUSH_METHOD
from kvtransfer.wire import WIRE_VERSION
from tests.kv_ends import FP32, LAYER_GROUPS, TOTAL_BLOCKS, KVEnd

BF16 = KVLayout(num_layers=5, num_kv_heads=3, head_dim=64, block_size_tokens=16, dtype="bfloat16")


def wait_for(predicate, timeout_s: float = 5.0, interval_s: float = 0.01):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


@pytest.fixture
def ends():
    """(sender end, receiver end) factories; every end must be back to all blocks free
    afterwards."""
    made: list[KVEnd] = []

    def make(layout: KVLayout = FP32) -> KVEnd:
        made.append(KVEnd.make(layout, TOTAL_BLOCKS))
        return made[-1]

    yield make
    for end in made:
        assert end.all_free, (
            f"leaked {end.allocator.num_blocks - end.allocator.num_free_blocks} blocks"
        )


@pytest.fixture
def grpc_pair(ends):
    """A connected grpc sender and receiver on 127.0.0.1 (closed afterwards)."""
    closers = []

    def make(send_layout: KVLayout = FP32, recv_layout: KVLayout | None = None, **receiver_options):
        sender_end, receiver_end = ends(send_layout), ends(recv_layout or send_layout)
        receiver = create_receiver(
            "grpc",
            receiver_end.cache,
            receiver_end.allocator,
            host="127.0.0.1",
            port=0,
            **receiver_options,
        )
        sender = create_sender(
            "grpc", sender_end.cache, sender_end.allocator, "prefill-0", 1, chunk_bytes=64 << 10
        )
        closers.extend([sender.close, receiver.close])
        return sender, receiver, sender_end, receiver_end

    yield make
    for close in closers:
        close()


def open_handoff(
    sender,
    receiver,
    sender_end,
    num_blocks: int,
    reserve_timeout_s: float = 5.0,
    lease_s: float | None = None,
    first_layers: slice = slice(0, 1),
) -> list[int]:
    """Allocates, reserves, starts request "r" and ships its first layer group; returns the sender's
    blocks."""
    blocks = sender_end.allocator.allocate(num_blocks)
    receiver.reserve("r", num_blocks, timeout_s=reserve_timeout_s)
    sender.start("r", blocks, receiver.address, **({} if lease_s is None else {"lease_s": lease_s}))
    sender.send_layers("r", first_layers)
    return blocks


def settle(sender, receiver, request_id: str, timeout_s: float = 5.0):
    """Poll both sides until the request settles on each; returns (receiver ready/failed, sender
    events)."""
    outcome = {}

    def done():
        events = receiver.poll()
        outcome.update({rid: blocks for rid, blocks in events.ready.items()})
        outcome.update({rid: error for rid, error in events.failed})
        sender_events = sender.poll()
        outcome.update({("sender", rid): None for rid in sender_events.acknowledged})
        outcome.update({("sender", rid): error for rid, error in sender_events.failed})
        return request_id in outcome and ("sender", request_id) in outcome

    assert wait_for(done, timeout_s), f"request did not settle: {outcome}"
    return outcome[request_id], outcome[("sender", request_id)]


# --- wire format ---------------------------------------------------------------------------------


def header_for(layout: KVLayout = FP32, **changes) -> KVGroupHeader:
    header = KVGroupHeader(
        "req-1",
        "prefill-0",
        3,
        layout,
        0,
        layout.num_layers,
        2,
        2 * layout.bytes_per_block,
        0xDEADBEEF,
    )
    return dataclasses.replace(header, **changes)


def test_header_round_trip():
    header = header_for()
    assert KVGroupHeader.decode(header.encode(), FP32) == header


def test_header_version_mismatch_is_typed_error():
    other = WIRE_VERSION + 1
    with pytest.raises(
        WireVersionError, match=f"version {other} .* speaks version {WIRE_VERSION}"
    ) as caught:
        KVGroupHeader.decode(header_for(version=other).encode(), FP32)
    assert caught.value.request_id == "req-1"


def test_header_layout_mismatch_names_the_field():
    other = dataclasses.replace(FP32, block_size_tokens=8)
    with pytest.raises(LayoutMismatchError, match="block_size_tokens 8 != ours 4"):
        KVGroupHeader.decode(
            header_for(other, payload_bytes=2 * other.bytes_per_block).encode(), FP32
        )


@pytest.mark.parametrize(
    "garbage", [b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"version": 1})]
)
def test_header_garbage_is_wire_format_error(garbage):
    with pytest.raises(WireFormatError):
        KVGroupHeader.decode(garbage, FP32)


def test_header_payload_length_must_match_shape():
    with pytest.raises(WireFormatError, match="payload_bytes"):
        KVGroupHeader.decode(header_for(payload_bytes=7).encode(), FP32)


# --- grpc transport ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout,num_blocks", [(FP32, 1), (FP32, 7), (BF16, 3), (BF16, 20)])
@pytest.mark.parametrize("mode", ["whole", "layerwise"])
def test_grpc_round_trip_is_bit_identical(grpc_pair, layout, num_blocks, mode):
    layout = dataclasses.replace(layout, num_layers=4)
    sender, receiver, sender_end, receiver_end = grpc_pair(layout)
    sender_blocks = sender_end.allocator.allocate(num_blocks)
    sender_end.fill_random(sender_blocks, seed=num_blocks)
    expected = sender_end.blocks_bytes(sender_blocks).clone()
    receiver_blocks = receiver.reserve("r", num_blocks, timeout_s=5.0)

    sender.start("r", sender_blocks, receiver.address, lease_s=5.0)
    for layers in LAYER_GROUPS[mode]:
        assert sender.send_layers("r", layers) is None
    ready_blocks, sender_result = settle(sender, receiver, "r")

    assert ready_blocks == receiver_blocks and sender_result is None
    assert torch.equal(receiver_end.blocks_bytes(receiver_blocks), expected)
    assert sender_end.all_free  # acknowledged: the sender gave its blocks back
    receiver_end.allocator.free(receiver_blocks)  # the decode worker's turn, once the sequence ends


def corrupting(frames, frame_index: int):
    for index, frame in enumerate(frames):
        if index == frame_index:
            frame = bytes([frame[0] ^ 0x01]) + frame[1:]
        yield frame


# a byte of the first group's payload; of the last
@pytest.mark.parametrize("corrupt_frame", [1, 5])
def test_grpc_flipped_byte_is_caught_and_nothing_is_ready(grpc_pair, corrupt_frame):
    sender, receiver, sender_end, receiver_end = grpc_pair()
    blocks = sender_end.allocator.allocate(3)
    sender_end.fill_random(blocks)
    original_frames = sender._frames
    sender._frames = lambda stream: corrupting(original_frames(stream), corrupt_frame)
    receiver.reserve("r", 3, timeout_s=5.0)
    sender.start("r", blocks, receiver.address)
    # frames: h, payload, h, payload... (payload < 1 chunk)
    for layers in LAYER_GROUPS["layerwise"]:
        sender.send_layers("r", layers)

    receiver_error, sender_error = settle(sender, receiver, "r")
    assert isinstance(receiver_error, ChecksumError) and "nothing installed" in str(receiver_error)
    assert isinstance(sender_error, ChecksumError)


def test_grpc_layout_mismatch_fails_both_sides_at_first_message(grpc_pair):
    sender, receiver, sender_end, receiver_end = grpc_pair(
        FP32, dataclasses.replace(FP32, dtype="bfloat16")
    )
    # the stream stays open: the first header alone must fail it
    open_handoff(sender, receiver, sender_end, 2)
    receiver_error, sender_error = settle(sender, receiver, "r")
    for error in (receiver_error, sender_error):
        assert isinstance(
            error, LayoutMismatchError
        ) and "dtype 'float32' != ours 'bfloat16'" in str(error)


def test_grpc_version_mismatch_rejected_at_first_frame(grpc_pair):
    sender, receiver, _, _ = grpc_pair()
    receiver.reserve("r", 2, timeout_s=5.0)
    bad = header_for(request_id="r", version=WIRE_VERSION + 1).encode()
    with grpc.insecure_channel(receiver.address) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            channel.stream_unary(PUSH_METHOD)(iter([bad]), timeout=5.0)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert caught.value.details().startswith(
        f"WireVersionError: KV wire format version {WIRE_VERSION + 1}"
    )
    events = receiver.poll()
    assert isinstance(dict(events.failed)["r"], WireVersionError)


def test_grpc_sender_gone_mid_transfer_frees_reservation(grpc_pair):
    sender, receiver, sender_end, receiver_end = grpc_pair()
    open_handoff(sender, receiver, sender_end, 4, first_layers=slice(0, 2))
    wait_for(lambda: receiver._contexts.get("r") is not None)
    # what the receiver sees when the sender's process dies
    for channel in sender._channels.values():
        channel.close()
    error = wait_for(lambda: dict(receiver.poll().failed).get("r"), timeout_s=3.0)
    assert isinstance(error, TransferAbortedError)
    sender.abort("r")


def test_grpc_silent_sender_reservation_expires(grpc_pair):
    sender, receiver, sender_end, receiver_end = grpc_pair()
    # then the sender stalls, stream open
    open_handoff(sender, receiver, sender_end, 2, reserve_timeout_s=0.3)
    assert receiver.poll().failed == ()
    error = wait_for(lambda: dict(receiver.poll().failed).get("r"), timeout_s=3.0)
    assert isinstance(error, ReservationExpiredError) and "1/4 layers" in str(error)
    sender.abort("r")


def test_grpc_unacknowledged_lease_expires(grpc_pair):
    sender, receiver, sender_end, receiver_end = grpc_pair()
    # the last layers never go out: no ack can come
    open_handoff(sender, receiver, sender_end, 2, lease_s=0.3)
    receiver_result, sender_error = settle(sender, receiver, "r")
    assert isinstance(sender_error, LeaseExpiredError)
    # the stream was cut: reservation freed
    assert isinstance(receiver_result, TransferAbortedError)


def test_grpc_abort_by_sender_frees_both(grpc_pair):
    sender, receiver, sender_end, receiver_end = grpc_pair()
    open_handoff(sender, receiver, sender_end, 3)
    sender.abort("r")
    assert sender_end.all_free
    error = wait_for(lambda: dict(receiver.poll().failed).get("r"), timeout_s=3.0)
    assert isinstance(error, TransferAbortedError)


def test_grpc_abort_by_receiver_frees_both(grpc_pair):
    sender, receiver, sender_end, receiver_end = grpc_pair()
    open_handoff(sender, receiver, sender_end, 3)
    wait_for(lambda: receiver._contexts.get("r") is not None)
    assert receiver.abort("r") and receiver_end.all_free
    error = wait_for(lambda: dict(sender.poll().failed).get("r"), timeout_s=3.0)
    assert isinstance(error, TransferAbortedError)


def test_grpc_kv_for_unreserved_request_is_rejected(grpc_pair):
    sender, receiver, sender_end, _ = grpc_pair()
    blocks = sender_end.allocator.allocate(1)
    sender.start("never-reserved", blocks, receiver.address)
    sender.send_layers("never-reserved")
    error = wait_for(lambda: dict(sender.poll().failed).get("never-reserved"), timeout_s=3.0)
    assert "no KV reservation" in str(error)


def test_transports_are_imported_only_when_chosen():
    import subprocess
    import sys

    code = (
        "import sys, kvtransfer; assert 'ray' not in sys.modules and 'grpc' not in sys.modules; "
        "from engine.kv_cache import KVLayout\n"
        "try:\n kvtransfer.create_sender('nope')\nexcept ValueError as e: print(e)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "unknown KV transport 'nope'; known: grpc, ray" in result.stdout


def test_the_receiver_announces_each_layer_group_and_each_failure(grpc_pair):
    """A decode worker's loop sleeps until its receiver has news (`on_event`), so every installed
    group and every failure must announce itself, from whichever thread saw it."""
    sender, receiver, sender_end, receiver_end = grpc_pair()
    announced = []  # what the receiver's owner finds when it polls on each announcement
    receiver.on_event = lambda: announced.append(receiver.poll())
    open_handoff(sender, receiver, sender_end, 3, first_layers=slice(0, 1))
    assert wait_for(lambda: len(announced) == 1)
    assert not announced[0].ready and not announced[0].failed  # one layer of four: not ready yet
    sender.send_layers("r", slice(1, None))
    assert wait_for(lambda: any("r" in events.ready for events in announced))
    receiver_end.allocator.free(next(e.ready["r"] for e in announced if "r" in e.ready))
    assert wait_for(lambda: "r" in sender.poll().acknowledged)

    announced.clear()
    open_handoff(sender, receiver, sender_end, 3)
    assert wait_for(lambda: len(announced) == 1)
    sender.abort("r")
    assert wait_for(lambda: any(dict(events.failed).get("r") for events in announced))
