"""Overload and soak, bounded in count and time, loopback only: 200 concurrent streams against small
queue limits (some refused with RESOURCE_EXHAUSTED, every accepted one exact, memory back to its
baseline), then a steady load for a bounded time with no RSS growth beyond a stated bound."""

from __future__ import annotations

import asyncio
import json
import os
import time

import grpc
import pytest

from engine.telemetry import rss_bytes
from pdserve.client import PdserveClient
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

PROMPTS = ["The sun is", "Rivers flow", "My favourite food is", "In the morning I"]
STREAMS = 200
SOAK_S = float(os.environ.get("PDSERVE_SOAK_S", "45"))
RSS_BOUND_BYTES = 64 << 20  # allowed growth per process across the soak, after warm-up
REPORT = {}


@pytest.fixture(scope="module")
def system(harness):
    running = harness.start(num_prefill=1, num_decode=1, max_in_flight=48, max_waiting_for_kv=8)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def references(system):
    with system.client() as client:
        return {p: list(client.generate(client.request(p, max_tokens=8, temperature=0, ignore_eos=True)).token_ids)
                for p in PROMPTS}


async def _stream(stub, prompt: str) -> tuple[str, list[int]]:
    request = PdserveClient.request(prompt, max_tokens=8, temperature=0, ignore_eos=True)
    tokens: list[int] = []
    try:
        async for response in stub.Generate(request, timeout=120):
            tokens += response.token_ids
        return "ok", tokens
    except grpc.aio.AioRpcError as error:
        return error.code().name, [error.details()]


async def _burst(port: int, count: int) -> list[tuple[str, str, list[int]]]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GenerationStub(channel)
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(count)]
        results = await asyncio.gather(*(_stream(stub, p) for p in prompts))
    return [(p, kind, tokens) for p, (kind, tokens) in zip(prompts, results)]


def _worker_rss(system) -> dict[str, int]:
    return {w.worker_id: load.rss_bytes for w, load in asyncio.run_coroutine_threadsafe(
        system.system.worker_loads(), system.loop).result(30)}


def test_200_concurrent_streams_over_small_queues(system, references):
    baseline = system.wait_idle()
    started = time.monotonic()
    results = asyncio.run(_burst(system.port, STREAMS))
    elapsed_s = time.monotonic() - started
    kinds = [kind for _, kind, _ in results]
    refused = [tokens[0] for _, kind, tokens in results if kind == "RESOURCE_EXHAUSTED"]
    assert set(kinds) <= {"ok", "RESOURCE_EXHAUSTED"}, set(kinds)
    assert 0 < len(refused) < STREAMS
    assert all("retry later" in message for message in refused)
    assert all(tokens == references[prompt] for prompt, kind, tokens in results if kind == "ok")
    after = system.wait_idle()
    assert after.requests_in_flight == 0
    assert all(w.kv_blocks_free == w.kv_blocks_total for w in after.workers)
    assert system.system.router.active == 0 and system.system.router.waiting_for_kv == 0
    REPORT["burst"] = {"streams": STREAMS, "accepted": kinds.count("ok"), "refused": len(refused),
                       "seconds": round(elapsed_s, 1), "completed_before": baseline.requests_completed}


def test_soak_keeps_memory_flat(system, references):
    async def steady(port: int, until_s: float) -> int:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            done = 0

            async def client(index: int):
                nonlocal done
                while time.monotonic() < until_s:
                    prompt = PROMPTS[(index + done) % len(PROMPTS)]
                    kind, tokens = await _stream(stub, prompt)
                    assert kind == "ok" and tokens == references[prompt], (kind, tokens)
                    done += 1

            await asyncio.gather(*(client(i) for i in range(8)))
            return done

    asyncio.run(steady(system.port, time.monotonic() + 8))  # warm-up: allocator pools, caches
    system.wait_idle()
    router_before, workers_before = rss_bytes(), _worker_rss(system)
    served = asyncio.run(steady(system.port, time.monotonic() + SOAK_S))
    system.wait_idle()
    router_after, workers_after = rss_bytes(), _worker_rss(system)
    growth = {"router": router_after - router_before,
              **{w: workers_after[w] - workers_before[w] for w in workers_before}}
    REPORT["soak"] = {"seconds": SOAK_S, "requests": served, "rss_before_mib": {
        "router": router_before >> 20, **{w: v >> 20 for w, v in workers_before.items()}},
        "rss_after_mib": {"router": router_after >> 20, **{w: v >> 20 for w, v in workers_after.items()}}}
    path = os.environ.get("PDSERVE_OVERLOAD_REPORT")
    if path:
        with open(path, "w") as out:
            json.dump(REPORT, out, indent=1)
    assert served > 50
    assert all(delta < RSS_BOUND_BYTES for delta in growth.values()), growth


def test_a_grpc_deadline_ends_the_request_on_its_workers(system):
    received = []
    started = time.monotonic()
    with PdserveClient(port=system.port, timeout_s=2.0) as client:
        with pytest.raises(grpc.RpcError) as failure:
            for response in client.stream(client.request("Tell me a very long story.", max_tokens=2000, temperature=0,
                                                         ignore_eos=True)):
                received += response.token_ids
    assert failure.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert received and time.monotonic() - started < 10  # it was decoding when the deadline passed
    after = system.wait_idle(timeout_s=15)
    assert after.requests_in_flight == 0 and system.system.router.active == 0
    assert all(w.kv_blocks_free == w.kv_blocks_total for w in after.workers)
