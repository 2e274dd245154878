"""The device check's `kv_handoff` section: one request's KV between two processes, through the
`grpc` transport and through CUDA IPC, against a copy in one process and a pinned host round
trip."""

from __future__ import annotations

import statistics
import time

import torch

from gpu_common import QUICK, Clock, Sizes, time_call

# -- KV handoff between two processes --------------------------------------------------------------


def _ipc_receiver(requests, replies) -> None:
    """The decode side: opens each shared CUDA tensor (CUDA IPC), copies it into its own memory,
    answers."""
    while True:
        shared = requests.get()
        if shared is None:
            return
        target = torch.empty_like(shared)
        target.copy_(shared)
        torch.cuda.synchronize()
        replies.put(time.perf_counter())
        del shared, target


def _handoff_layout(quick: bool):
    from engine.config import NAMED_SHAPES
    from engine.kv_cache import KVLayout

    if quick:
        return KVLayout(
            num_layers=2, num_kv_heads=2, head_dim=64, block_size_tokens=16, dtype="bfloat16"
        )
    return KVLayout.for_model(NAMED_SHAPES["llama-3-8b"], 16, torch.bfloat16)


def _grpc_receiver(device: str, quick: bool, num_blocks: int, requests, replies) -> None:
    """The decode side of a `grpc` handoff: a paged cache on `device`, a receiver, and for each
    request it is told of: reserve, wait until ready, report when (perf_counter: one clock for the
    machine)."""
    from engine.block_manager import BlockAllocator
    from engine.kv_cache import PagedKVCache
    from kvtransfer import create_receiver

    layout = _handoff_layout(quick)
    allocator = BlockAllocator(num_blocks, layout.block_size_tokens, enable_prefix_caching=False)
    receiver = create_receiver(
        "grpc", PagedKVCache(layout, num_blocks, device), allocator, host="127.0.0.1", port=0
    )
    replies.put(receiver.address)
    while (message := requests.get()) is not None:
        request_id, blocks = message
        reserved = receiver.reserve(request_id, blocks, timeout_s=60)
        replies.put("reserved")
        while True:
            events = receiver.poll()
            if request_id in events.ready:
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                replies.put(time.perf_counter())
                allocator.free(reserved)
                break
            if request_id in dict(events.failed):
                replies.put(f"failed: {dict(events.failed)[request_id]}")
                break
            time.sleep(0.0002)
    receiver.close()


def _grpc_handoffs(device: str, sizes: Sizes, rows: list[dict]) -> None:
    """Each row's prompt shipped with the `grpc` transport between two processes, KV staged through
    pinned host buffers on both sides (kvtransfer; engine.kv_cache.PagedKVCache.export_blocks): GB/s
    of the whole handoff, from `send_layers` to the receiver's blocks installed on its device."""
    import torch.multiprocessing as mp

    from engine.block_manager import BlockAllocator
    from engine.kv_cache import PagedKVCache
    from kvtransfer import create_sender

    quick = sizes is QUICK
    layout = _handoff_layout(quick)
    num_blocks = max(row["prompt_tokens"] for row in rows) // layout.block_size_tokens + 1
    context = mp.get_context("spawn")
    requests, replies = context.Queue(), context.Queue()
    receiver = context.Process(
        target=_grpc_receiver, args=(device, quick, num_blocks, requests, replies), daemon=True
    )
    receiver.start()
    allocator = BlockAllocator(num_blocks, layout.block_size_tokens, enable_prefix_caching=False)
    cache = PagedKVCache(layout, num_blocks, device)
    sender = create_sender("grpc", cache, allocator, "gpu-check", 1)
    try:
        address = replies.get(timeout=120)
        for row in rows:
            blocks_per_request, times = row["prompt_tokens"] // layout.block_size_tokens, []
            for attempt in range(sizes.repeats + 1):  # the first: connection and buffers, a warm-up
                request_id = f"grpc-{row['prompt_tokens']}-{attempt}"
                blocks = allocator.allocate(blocks_per_request)
                requests.put((request_id, blocks_per_request))
                assert replies.get(timeout=60) == "reserved"
                started = time.perf_counter()
                sender.start(request_id, blocks, address, lease_s=120)
                sender.send_layers(request_id)
                ready = replies.get(timeout=120)
                if isinstance(ready, str):
                    raise RuntimeError(f"grpc handoff {request_id}: {ready}")
                times.append(ready - started)
                deadline = time.monotonic() + 30
                while request_id not in sender.poll().acknowledged and time.monotonic() < deadline:
                    time.sleep(0.001)
            row["grpc_bytes"] = blocks_per_request * layout.bytes_per_block
            row["grpc_gb_s"] = row["grpc_bytes"] / statistics.median(times[1:]) / 1e9
    finally:
        sender.close()
        requests.put(None)
        receiver.join(timeout=30)


def _export_bytes(prompt_tokens: int) -> int:
    return _handoff_layout(quick=False).bytes_per_token() * prompt_tokens


def check_kv_handoff(device: str, sizes: Sizes) -> dict:
    rows = []
    clock = Clock(device)
    for prompt_tokens in sizes.handoff_prompt_tokens:
        num_bytes = _export_bytes(prompt_tokens)
        source = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device=device)
        target = torch.empty_like(source)
        copy_s = time_call(lambda: target.copy_(source), clock, sizes.repeats)
        pinned = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=device.startswith("cuda"))
        staged_s = time_call(
            lambda: (pinned.copy_(source), target.copy_(pinned)), clock, sizes.repeats
        )
        row = {
            "prompt_tokens": prompt_tokens,
            "kv_bytes": num_bytes,
            "device_copy_gb_s": num_bytes / copy_s / 1e9,
            "pinned_round_trip_gb_s": num_bytes / staged_s / 1e9,
        }
        rows.append(row)
    _grpc_handoffs(device, sizes, rows)
    if not device.startswith("cuda"):
        return {"cases": rows, "cuda_ipc": "skipped: needs CUDA"}
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    requests, replies = context.Queue(), context.Queue()
    receiver = context.Process(target=_ipc_receiver, args=(requests, replies), daemon=True)
    receiver.start()
    try:
        for row in rows:
            times = []
            for _ in range(sizes.repeats + 1):  # the first opens the IPC handle: warm-up
                source = torch.randint(0, 255, (row["kv_bytes"],), dtype=torch.uint8, device=device)
                torch.cuda.synchronize()
                started = time.perf_counter()
                requests.put(source)
                times.append(replies.get(timeout=60) - started)
            row["cuda_ipc_gb_s"] = row["kv_bytes"] / statistics.median(times[1:]) / 1e9
            row["cuda_ipc_first_s"] = times[0]
    finally:
        requests.put(None)
        receiver.join(timeout=30)
    return {"cases": rows}
