"""The KV handoff timed as the system does it: two Ray actors (a prefill end and a decode end, one
CPU and one torch thread each) with paged caches of the model's KV layout, a sender and a receiver
of the named transport. One handoff runs from the receiver's reservation to its report that the KV
is installed and verified; for `ray` the driver routes the delivery (as the router does), for `grpc`
the sender streams straight to the receiver's server on 127.0.0.1. The method of
benchmarks/kv_transfer_bench.py, without its comparisons.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Sequence

from pdserve.planner.profile import HandoffPoint


class _End:
    """One end: a cache, an allocator, and the transport's sender or receiver."""

    def __init__(self, layout, num_blocks: int, transport: str, role: str, **options):
        import torch

        from engine.block_manager import BlockAllocator
        from engine.kv_cache import PagedKVCache
        from kvtransfer.registry import create_receiver, create_sender

        torch.set_num_threads(1)
        self.cache = PagedKVCache(layout, num_blocks)
        self.allocator = BlockAllocator(
            num_blocks, layout.block_size_tokens, enable_prefix_caching=False
        )
        if role == "sender":
            self.side = create_sender(
                transport, self.cache, self.allocator, "profile-prefill", 1, **options
            )
        else:
            self.side = create_receiver(transport, self.cache, self.allocator, **options)

    def address(self):
        return self.side.address

    def allocate(self, num_blocks: int) -> list[int]:
        return self.allocator.allocate(num_blocks)

    def free(self, block_ids: Sequence[int]) -> None:
        self.allocator.free(list(block_ids))

    def reserve(self, request_id: str, num_blocks: int) -> list[int]:
        return self.side.reserve(request_id, num_blocks, 60.0)

    def send(self, request_id: str, block_ids, destination):
        self.side.start(request_id, block_ids, destination, lease_s=60.0)
        return self.side.send_layers(request_id, slice(None))

    def deliver(self, delivery) -> None:
        self.side.deliver(delivery)

    def wait_ready(self, request_id: str, timeout_s: float = 60.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            events = self.side.poll()
            if request_id in getattr(events, "ready", {}):
                return events.ready[request_id]
            for failed_id, error in events.failed:
                if failed_id == request_id:
                    raise RuntimeError(f"handoff {request_id} failed: {error}")
            time.sleep(0.0005)
        raise TimeoutError(f"handoff {request_id}: no KV within {timeout_s} s")

    def settle(self, request_id: str, timeout_s: float = 60.0) -> None:
        # routed: the router relays the acknowledgement
        if type(self.side).__name__ == "RayKVSender":
            self.side.acknowledge(request_id)
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if request_id in getattr(self.side.poll(), "acknowledged", ()):
                return
            time.sleep(0.0005)

    def close(self) -> None:
        self.side.close()


def measure_handoff(
    layout, transport: str, prompt_tokens: Sequence[int], repeats: int
) -> list[HandoffPoint]:
    """Median handoff time per prompt length (after one warm-up), one pair of actors for all
    lengths. Starts a local Ray node (on 127.0.0.1) unless one is up; shuts it down if it started
    it."""
    # read at import: keeps Ray on 127.0.0.1
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_preallocate_plasma_memory", "1")
    import ray

    started_ray = not ray.is_initialized()
    max_blocks = -(-max(prompt_tokens) // layout.block_size_tokens)
    if started_ray:
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            object_store_memory=max(256 << 20, 4 * max_blocks * layout.bytes_per_block),
            log_to_driver=False,
            configure_logging=False,
            runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}},
        )
    actor = ray.remote(num_cpus=1)(_End)
    options = (
        {"receive_buffer_bytes": max_blocks * layout.bytes_per_block} if transport == "grpc" else {}
    )
    prefill = actor.remote(layout, max_blocks, transport, "sender")
    decode = actor.remote(layout, max_blocks, transport, "receiver", **options)
    points = []
    try:
        address = ray.get(decode.address.remote())
        for tokens in prompt_tokens:
            num_blocks = -(-tokens // layout.block_size_tokens)
            samples = []
            for index in range(repeats + 1):
                request_id = f"h{tokens}-{index}"
                block_ids = ray.get(prefill.allocate.remote(num_blocks))
                ray.get(decode.reserve.remote(request_id, num_blocks))
                began = time.perf_counter()
                delivery = ray.get(prefill.send.remote(request_id, block_ids, address))
                if delivery is not None:
                    ray.get(decode.deliver.remote(delivery))
                reserved = ray.get(decode.wait_ready.remote(request_id))
                samples.append(time.perf_counter() - began)
                ray.get(prefill.settle.remote(request_id))
                ray.get(decode.free.remote(reserved))
            points.append(
                HandoffPoint(
                    transport, num_blocks * layout.bytes_per_block, statistics.median(samples[1:])
                )
            )
    finally:
        ray.get([prefill.close.remote(), decode.close.remote()])
        ray.kill(prefill)
        ray.kill(decode)
        if started_ray:
            ray.shutdown()
    return points


def measure_inproc(
    cache, block_ids_for, prompt_tokens: Sequence[int], repeats: int
) -> list[HandoffPoint]:
    """The floor without a transport (`--quick`): export the blocks and import them into others of
    the same cache, in this process. `block_ids_for(n)` -> two lists of n free blocks."""
    points = []
    for tokens in prompt_tokens:
        num_blocks = -(-tokens // cache.layout.block_size_tokens)
        source, target = block_ids_for(num_blocks)
        samples = []
        for _ in range(repeats + 1):
            began = time.perf_counter()
            cache.import_blocks(target, cache.export_blocks(source))
            samples.append(time.perf_counter() - began)
        points.append(
            HandoffPoint(
                "inproc", num_blocks * cache.layout.bytes_per_block, statistics.median(samples[1:])
            )
        )
    return points
