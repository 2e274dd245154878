"""Test and benchmark helpers for kvtransfer: one end of a handoff (a paged cache and its allocator)
with random KV."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from engine.block_manager import BlockAllocator
from engine.kv_cache import KVLayout, PagedKVCache

# Small layouts and sizes the kvtransfer tests share.
FP32 = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, block_size_tokens=4, dtype="float32")
LAYER_GROUPS = {"whole": [slice(None)], "layerwise": [slice(0, 1), slice(1, 3), slice(3, None)]}
TOTAL_BLOCKS = 48


@dataclass(frozen=True)
class KVEnd:
    cache: PagedKVCache
    allocator: BlockAllocator

    @classmethod
    def make(cls, layout: KVLayout, num_blocks: int) -> "KVEnd":
        return cls(
            PagedKVCache(layout, num_blocks),
            BlockAllocator(num_blocks, layout.block_size_tokens, enable_prefix_caching=False),
        )

    def fill_random(self, block_ids: Sequence[int], seed: int = 0) -> None:
        """Arbitrary bit patterns (NaNs and infinities included), so equality below is bit
        equality."""
        generator = torch.Generator().manual_seed(seed)
        data = self.cache.export_blocks(block_ids)
        bits = data.view(torch.uint8)
        bits.copy_(torch.randint(0, 256, bits.shape, dtype=torch.uint8, generator=generator))
        self.cache.import_blocks(block_ids, data)

    def fill_normal(self, block_ids: Sequence[int], seed: int = 0) -> None:
        """Finite values, a spread per head (the lossy wire modes are for finite KV)."""
        generator = torch.Generator().manual_seed(seed)
        data = self.cache.export_blocks(block_ids)
        values = torch.randn(data.shape, generator=generator)
        values *= torch.rand(data.shape[:3] + (1, data.shape[4], 1), generator=generator) * 8
        self.cache.import_blocks(block_ids, values.to(data.dtype))

    def blocks_bytes(self, block_ids: Sequence[int], layers: slice = slice(None)) -> torch.Tensor:
        return self.cache.export_blocks(block_ids, layers).view(torch.uint8)

    @property
    def all_free(self) -> bool:
        return self.allocator.num_free_blocks == self.allocator.num_blocks


class KVEndWorker:
    """One end of a handoff as a Ray actor body (`ray.remote(num_cpus=1)(KVEndWorker)`): a cache, an
    allocator and a sender or receiver of the named transport. Used by tests and the benchmark."""

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        transport: str,
        role: str,
        torch_threads: int = 1,
        **transport_options,
    ):
        from kvtransfer.registry import create_receiver, create_sender

        torch.set_num_threads(torch_threads)
        self.end = KVEnd.make(layout, num_blocks)
        if role == "sender":
            self.side = create_sender(
                transport,
                self.end.cache,
                self.end.allocator,
                "prefill-test",
                1,
                **transport_options,
            )
        else:
            self.side = create_receiver(
                transport, self.end.cache, self.end.allocator, **transport_options
            )

    def address(self):
        return self.side.address

    def allocate_random(self, num_blocks: int, seed: int = 0, finite: bool = False) -> list[int]:
        """Blocks of arbitrary bits, or (`finite`) of finite values the lossy wire modes carry."""
        block_ids = self.end.allocator.allocate(num_blocks)
        (self.end.fill_normal if finite else self.end.fill_random)(block_ids, seed)
        return block_ids

    def blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        return self.end.cache.export_blocks(block_ids)

    def digest(self, block_ids: Sequence[int]) -> int:
        import zlib

        return zlib.crc32(self.end.blocks_bytes(block_ids).numpy())

    def reserve(self, request_id: str, num_blocks: int, timeout_s: float) -> list[int]:
        return self.side.reserve(request_id, num_blocks, timeout_s)

    def start(
        self, request_id: str, block_ids, destination=None, lease_s: float = 30.0, wire="none"
    ) -> None:
        self.side.start(request_id, block_ids, destination, lease_s, wire)

    def send(self, request_id: str, layer_start: int, layer_stop: int):
        return self.side.send_layers(request_id, slice(layer_start, layer_stop))

    def deliver(self, delivery):
        """The receiver's `deliver`, with the error returned as (type name, message) instead of
        raised."""
        try:
            return self.side.deliver(delivery)
        except Exception as error:  # the test asserts on it
            return type(error).__name__, str(error)

    def wait_settled(self, request_id: str, timeout_s: float):
        """Poll until the request settles: ("ready", block ids) / ("acknowledged", None) /
        (error type name, message), or ("pending", None) at the timeout."""
        import time

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            events = self.side.poll()
            if request_id in getattr(events, "ready", {}):
                return "ready", events.ready[request_id]
            if request_id in getattr(events, "acknowledged", ()):
                return "acknowledged", None
            for failed_id, error in events.failed:
                if failed_id == request_id:
                    return type(error).__name__, str(error)
            time.sleep(0.001)
        return "pending", None

    def acknowledge(self, request_id: str) -> None:
        self.side.acknowledge(request_id)

    def abort(self, request_id: str) -> None:
        self.side.abort(request_id)

    def free(self, block_ids: Sequence[int]) -> None:
        self.end.allocator.free(block_ids)

    def free_and_total_blocks(self) -> tuple[int, int]:
        return self.end.allocator.num_free_blocks, self.end.allocator.num_blocks

    def close(self) -> None:
        self.side.close()


def one_fake_gpu(monkeypatch) -> dict:
    """CPU tensors stand for one GPU's memory (kvtransfer/cuda_ipc.py on CPU): the GPU has a UUID,
    `share` registers a buffer (returned: id -> buffer), `open_shared` returns it."""
    from kvtransfer import cuda_ipc

    shared: dict[int, torch.Tensor] = {}

    def share(buffer):
        shared[id(buffer)] = buffer
        return (id(buffer),)

    monkeypatch.delenv(cuda_ipc.ENV, raising=False)
    monkeypatch.setattr(cuda_ipc, "enabled", lambda device: True)
    monkeypatch.setattr(cuda_ipc, "device_uuid", lambda device: "GPU-test")
    monkeypatch.setattr(cuda_ipc, "share", share)
    monkeypatch.setattr(cuda_ipc, "open_shared", lambda handle, device: shared[handle[0]])
    return shared


def assert_within_wire_bounds(original: torch.Tensor, received: torch.Tensor, wire: str) -> None:
    """`received` is what `wire` (kvtransfer/codecs.py) may make of `original`: the same bits for
    none and lossless; for int8 within scale / 2 of each value, for fp8 within 1/16 of it plus
    scale * 2^-10, where scale is its (layer, k/v, block, head)'s largest magnitude over 127 / 448;
    plus the cache dtype's rounding of the result."""
    if wire in ("none", "lossless"):
        assert torch.equal(original.view(torch.uint8), received.view(torch.uint8))
        return
    assert received.dtype == original.dtype and received.shape == original.shape
    values, got = original.float(), received.float()
    amax = values.abs().amax(dim=(3, 5), keepdim=True)
    scale = amax / (127.0 if wire == "int8" else 448.0)
    bound = scale / 2 if wire == "int8" else values.abs() / 16 + scale * 2**-10
    rounding = got.abs() * (2**-8 if original.dtype == torch.bfloat16 else 2**-20)
    excess = (got - values).abs() - (bound * 1.0001 + rounding)
    assert excess.max().item() <= 0, f"{wire}: an error exceeds its bound by {excess.max().item()}"
    assert (got - values).abs().max().item() > 0, f"{wire} left every value exact: not encoded?"
