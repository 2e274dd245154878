"""The KV wire's modes (kvtransfer/codecs.py, protocol/kv_wire.py, router/kv_wire.py): codec round
trips, the header's rules for them, a grpc handoff in each mode, and the router's choice."""

from __future__ import annotations

import dataclasses
import math

import grpc
import pytest
import torch

from engine.kv_cache import KVLayout
from kvtransfer import KVGroupHeader, WireFormatError, codecs
from kvtransfer.grpc_transport import PUSH_METHOD
from protocol.kv_wire import CODEC_COSTS, WIRE_MODES
from router.kv_wire import KVWireConfig, choose
from router.links import LinkEstimate
from tests import test_kvtransfer
from tests.kv_ends import FP32, LAYER_GROUPS, KVEnd, assert_within_wire_bounds
from tests.test_kvtransfer import header_for, settle

ends, grpc_pair = test_kvtransfer.ends, test_kvtransfer.grpc_pair  # fixtures shared with it

BF16 = KVLayout(num_layers=4, num_kv_heads=3, head_dim=64, block_size_tokens=16, dtype="bfloat16")
FP32_WIDE = dataclasses.replace(BF16, dtype="float32")


def _exported(layout: KVLayout, num_blocks: int, seed: int = 0) -> torch.Tensor:
    end = KVEnd.make(layout, num_blocks)
    blocks = list(range(num_blocks))
    end.fill_normal(blocks, seed)
    return end.cache.export_blocks(blocks)


@pytest.mark.parametrize("layout", [FP32_WIDE, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("wire", ["lossless", "fp8", "int8"])
def test_codec_round_trip_within_its_bounds(layout, wire):
    data = _exported(layout, 5)
    mode, encoded = codecs.encode(data, wire)
    assert mode == wire and encoded.dtype == torch.uint8
    assert encoded.numel() < data.numel() * data.element_size()
    assert codecs.codec(wire).check_length(encoded.numel(), layout, layout.num_layers, 5) is None
    decoded = codecs.codec(wire).decode(encoded, layout, layout.num_layers, 5)
    assert_within_wire_bounds(data, decoded, wire)


def test_lossless_of_incompressible_bits_goes_as_none():
    end = KVEnd.make(FP32, 3)
    end.fill_random([0, 1, 2])
    data = end.cache.export_blocks([0, 1, 2])
    mode, wire = codecs.encode(data, "lossless")
    assert mode == "none" and torch.equal(wire, data.reshape(-1).view(torch.uint8))


def test_header_carries_the_wire_mode_and_checks_its_length():
    raw = 2 * FP32.bytes_per_block
    header = header_for(wire="lossless", payload_bytes=raw // 3)
    assert KVGroupHeader.decode(header.encode(), FP32) == header
    with pytest.raises(WireFormatError, match="lossless wire"):  # no smaller than the raw group
        KVGroupHeader.decode(header_for(wire="lossless", payload_bytes=raw).encode(), FP32)
    with pytest.raises(WireFormatError, match="fp8 wire"):
        KVGroupHeader.decode(header_for(wire="fp8", payload_bytes=raw // 4).encode(), FP32)


def test_an_unknown_mode_is_refused_at_the_first_message(grpc_pair):
    with pytest.raises(WireFormatError, match="'zfp' is not one this receiver decodes") as caught:
        KVGroupHeader.decode(header_for(wire="zfp").encode(), FP32)
    assert caught.value.request_id == "req-1"
    sender, receiver, _, _ = grpc_pair()
    receiver.reserve("r", 2, timeout_s=5.0)
    with grpc.insecure_channel(receiver.address) as channel:
        with pytest.raises(grpc.RpcError) as rpc:
            channel.stream_unary(PUSH_METHOD)(
                iter([header_for(request_id="r", wire="zfp").encode()]), timeout=5.0
            )
    assert rpc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "zfp" in rpc.value.details() and "lossless" in rpc.value.details()
    assert "r" in dict(receiver.poll().failed)


def test_a_lossless_frame_that_lies_about_its_size_is_refused():
    data = _exported(BF16, 2)
    _, wire = codecs.encode(data, "lossless")
    other = dataclasses.replace(BF16, num_layers=2)  # the same frame, read as a smaller group
    with pytest.raises(WireFormatError, match="frame holds"):
        codecs.codec("lossless").decode(wire, other, 2, 2)


@pytest.mark.parametrize("layout", [FP32_WIDE, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("wire", WIRE_MODES)
@pytest.mark.parametrize("groups", ["whole", "layerwise"])
def test_grpc_handoff_in_each_mode(grpc_pair, layout, wire, groups):
    sender, receiver, sender_end, receiver_end = grpc_pair(layout)
    blocks = sender_end.allocator.allocate(6)
    sender_end.fill_normal(blocks, seed=6)
    original = sender_end.cache.export_blocks(blocks)
    reserved = receiver.reserve("r", 6, timeout_s=5.0)
    sender.start("r", blocks, receiver.address, lease_s=5.0, wire=wire)
    for layers in LAYER_GROUPS[groups]:
        sender.send_layers("r", layers)
    sent_mode, wire_bytes = sender.wire_sent("r")
    assert sent_mode == wire
    raw_bytes = 6 * layout.bytes_per_block
    assert (wire_bytes == raw_bytes) if wire == "none" else (wire_bytes < raw_bytes)
    ready, sender_result = settle(sender, receiver, "r")
    assert ready == reserved and sender_result is None
    assert_within_wire_bounds(original, receiver_end.cache.export_blocks(reserved), wire)
    receiver_end.allocator.free(reserved)


def test_a_sender_refuses_an_unknown_mode(grpc_pair):
    sender, receiver, sender_end, _ = grpc_pair()
    blocks = sender_end.allocator.allocate(1)
    with pytest.raises(ValueError, match="wire mode must be one of"):
        sender.start("r", blocks, receiver.address, wire="zfp")
    sender_end.allocator.free(blocks)


# --- the router's choice -------------------------------------------------------------------------


def _link(bandwidth_bytes_per_s: float, latency_s: float = 0.0005) -> LinkEstimate:
    return LinkEstimate(latency_s, bandwidth_bytes_per_s, 8, 1 << 20, 0.01)


def test_lossy_modes_need_the_users_leave():
    with pytest.raises(ValueError, match="needs --kv-wire-lossy ok"):
        KVWireConfig("fp8")
    with pytest.raises(ValueError, match="--kv-wire must be one of"):
        KVWireConfig("zstd")
    assert KVWireConfig("auto").candidates == ("none", "lossless")
    assert KVWireConfig("int8", lossy_ok=True).candidates == WIRE_MODES


def test_auto_picks_what_delivers_sooner():
    kv_bytes = 12 << 20  # a 512-token prompt of the default model in bf16
    auto = KVWireConfig()
    assert choose(KVWireConfig("lossless"), kv_bytes, "bfloat16", None)[:2] == ("lossless", "asked")
    assert choose(auto, kv_bytes, "bfloat16", None)[:2] == ("none", "no_link")
    # 500 Mbit/s: shuffle + zstd (0.69 of the bytes, ~32 ms of codec on one core) beats 200 ms of
    # raw bf16 KV; at 1 Gbit/s the codec costs about what it saves
    slow = choose(auto, kv_bytes, "bfloat16", _link(62.5e6))
    assert slow.mode == "lossless" and slow.reason == "faster"
    assert choose(auto, kv_bytes, "bfloat16", _link(125e6))[:2] == ("none", "no_gain")
    # on loopback-like links the codec costs more than it saves
    assert choose(auto, kv_bytes, "bfloat16", _link(5e9)).mode == "none"
    assert choose(auto, kv_bytes, "bfloat16", _link(5e9)).reason == "no_gain"
    # allowed, a lossy mode wins on the slow link
    lossy = choose(KVWireConfig(lossy_ok=True), kv_bytes, "float32", _link(62.5e6))
    assert lossy.mode in ("fp8", "int8") and lossy.predicted_s < slow.predicted_s
    # a small prompt on a fast link stays raw
    assert choose(auto, 64 << 10, "bfloat16", _link(1e9)).mode == "none"


def test_every_mode_and_dtype_has_a_measured_cost():
    for wire in WIRE_MODES:
        for dtype in ("float32", "bfloat16"):
            cost = CODEC_COSTS[(wire, dtype)]
            assert 0 < cost.wire_ratio <= 1 and cost.codec_s(1 << 20) >= 0
    assert CODEC_COSTS[("none", "float32")].codec_s(1 << 20) == 0 and math.isinf(
        CODEC_COSTS[("none", "float32")].encode_bytes_per_s
    )


def test_serve_flags_reach_the_router_config():
    from pdserve.cli import _serve_config, build_parser

    def config(*flags):
        return _serve_config(build_parser().parse_args(["serve", *flags]))

    assert config().kv_wire_config == KVWireConfig("auto", lossy_ok=False)
    wire = config("--kv-wire", "int8", "--kv-wire-lossy", "ok").kv_wire_config
    assert wire == KVWireConfig("int8", lossy_ok=True)
    with pytest.raises(ValueError, match="needs --kv-wire-lossy ok"):
        config("--kv-wire", "fp8")
