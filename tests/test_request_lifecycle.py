"""A request's life on a real system, at its edges: aborted mid-prefill, an id used twice at once, a
client that leaves at any moment, a prefill queue longer than the KV timeout, and a context the KV
cache cannot hold. Each ends at once, frees every block and disturbs nothing else."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdserve.client import PdserveClient
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

KV_TIMEOUT_S = 2.0  # short, so a prefill queue outlasts it
# ~1,700 tokens: seconds of prefill
LONG_PROMPT = "Rivers shaped where people settled, traded and fought. " * 170


@pytest.fixture(scope="module")
def system(harness):
    running = harness.start(
        num_prefill=2,
        num_decode=1,
        transport="grpc",
        kv_timeout_s=KV_TIMEOUT_S,
        kv_cache_bytes=256 << 20,
        http_port=0,
    )
    yield running
    running.stop()


def _router(system):
    return system.system.router


def _all_free(system, timeout_s: float) -> bool:
    """True once nothing is in flight and every worker's KV is free, within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = system.stats()
        if stats.requests_in_flight == 0 and all(
            w.kv_blocks_free == w.kv_blocks_total for w in stats.workers
        ):
            return True
        time.sleep(0.05)
    return False


def _post(system, path: str, body: dict, headers: dict = None):
    request = urllib.request.Request(
        f"http://127.0.0.1:{system.system.http_port}{path}",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_abort_mid_prefill_ends_the_stream_at_once_and_frees_everything(system):
    router = _router(system)
    responses, ended = [], threading.Event()

    def run():
        with system.client(timeout_s=120) as client:
            for response in client.stream(
                client.request(LONG_PROMPT, request_id="abort-me", max_tokens=8)
            ):
                responses.append(response)
        ended.set()

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 30
    while not router.route_of("abort-me"):
        assert time.monotonic() < deadline, "the request never reached a prefill worker"
        time.sleep(0.01)
    time.sleep(0.3)  # the prefill worker is inside the prompt's forward pass now
    route = router.route_of("abort-me")
    with system.client() as client:
        started = time.monotonic()
        assert client.abort("abort-me") is True
    assert ended.wait(2.0), "the Generate stream did not end within 2 s of the abort"
    assert time.monotonic() - started < 2.0
    thread.join(5)
    assert responses and responses[-1].finish_reason == "abort"
    assert all(w.in_flight == 0 for w in router.prefill_pool.workers + router.decode_pool.workers)
    assert _all_free(system, 30), system.stats()
    # The prefill worker that held it drains and stops (its in-flight count came back to 0).
    pools = system.system.pools
    stopped_before = len(pools.stopped)
    other = next(w for w in router.prefill_pool.workers if w is not route.prefill)
    other.in_flight += 1  # keep the scale-down's choice on the worker that held the aborted request
    try:
        with system.client() as client:
            assert client.scale(prefill=1).prefill == 1
        deadline = time.monotonic() + 20
        while len(pools.stopped) == stopped_before:
            assert time.monotonic() < deadline, (
                "the prefill worker that held the aborted request never drained"
            )
            time.sleep(0.1)
        assert pools.stopped[-1].worker_id == route.prefill.worker_id
    finally:
        other.in_flight -= 1
    with system.client() as client:
        assert client.scale(prefill=2).prefill == 2


def test_the_same_request_id_twice_at_once_is_refused_and_the_first_is_untouched(system):
    with system.client() as client:
        reference = list(
            client.generate(
                client.request("Count to twenty:", max_tokens=24, temperature=0, ignore_eos=True)
            ).token_ids
        )

    async def both_at_once(request_id: str):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{system.port}") as channel:
            stub = pb_grpc.GenerationStub(channel)

            async def one():
                request = PdserveClient.request(
                    "Count to twenty:",
                    request_id=request_id,
                    max_tokens=24,
                    temperature=0,
                    ignore_eos=True,
                )
                started, tokens = time.monotonic(), []
                try:
                    async for response in stub.Generate(request, timeout=60):
                        tokens += response.token_ids
                    return "ok", tokens, time.monotonic() - started
                except grpc.aio.AioRpcError as error:
                    return error.code(), error.details(), time.monotonic() - started

            return await asyncio.gather(one(), one())

    outcomes = sorted(asyncio.run(both_at_once("same-id-1")), key=lambda o: str(o[0]))
    assert [o[0] for o in outcomes] == [grpc.StatusCode.ALREADY_EXISTS, "ok"], outcomes
    refused, served = outcomes
    assert "same-id-1" in refused[1] and refused[2] < 2.0
    assert served[1] == reference
    body = {
        "model": system.system.config.model_name,
        "prompt": "Count to twenty:",
        "max_tokens": 8,
        "stream": True,
    }
    with ThreadPoolExecutor(2) as pool:
        statuses = sorted(
            pool.map(
                lambda _: _post(system, "/v1/completions", body, {"X-Request-Id": "same-id-2"}),
                range(2),
            )
        )
    assert [status for status, _ in statuses] == [200, 409], statuses
    assert json.loads(statuses[1][1])["error"]["param"] == "X-Request-Id"
    assert _all_free(system, 10)


def test_a_client_leaving_at_any_moment_frees_everything_within_a_second(system):
    async def leave_after(stub, delay_s: float, index: int) -> None:
        call = stub.Generate(
            PdserveClient.request(
                f"Story number {index}: once upon a time", max_tokens=32, ignore_eos=True
            )
        )

        async def read():
            async for _ in call:
                pass

        reader = asyncio.ensure_future(read())
        await asyncio.sleep(delay_s)
        call.cancel()
        try:
            await reader
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            pass

    async def sweep():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{system.port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            # Staggered leave times cover every phase: admission, the decode reservation, prefill,
            # decode.
            await asyncio.gather(*(leave_after(stub, 0.002 * i, i) for i in range(60)))

    asyncio.run(sweep())
    assert _all_free(system, 1.5), system.stats()


def test_a_prefill_queue_longer_than_the_kv_timeout_serves_every_request(system):
    prompts = [
        f"Request {i}. " + "Rivers shaped where people settled, traded and fought. " * 60
        for i in range(5)
    ]
    with ThreadPoolExecutor(len(prompts)) as pool:

        def one(prompt):
            with system.client() as client:
                return client.generate(
                    client.request(prompt, max_tokens=6, temperature=0, ignore_eos=True)
                )

        started = time.monotonic()
        done = list(pool.map(one, prompts))
    waited_s = time.monotonic() - started
    assert waited_s > KV_TIMEOUT_S * 1.5, (
        f"the queue ({waited_s:.1f} s) did not outlast the KV timeout"
    )
    assert all(len(d.token_ids) == 6 and d.finish_reason == "length" for d in done), done
    assert _all_free(system, 10)


@pytest.fixture(scope="module")
def small_cache_system(harness):
    # fp32: 364 tokens
    running = harness.start(num_prefill=1, num_decode=1, kv_cache_bytes=16 << 20, http_port=0)
    yield running
    running.stop()


def test_the_served_context_is_what_the_kv_cache_holds(small_cache_system):
    system = small_cache_system
    decode = system.system.router.decode_pool.workers[0].info
    capacity = decode.kv_blocks_total * system.system.config.block_size_tokens
    assert capacity < decode.model_context_tokens
    stats = system.stats()
    assert (
        stats.max_context_tokens == capacity
        and stats.model_context_tokens == decode.model_context_tokens
    )
    with urllib.request.urlopen(
        f"http://127.0.0.1:{system.system.http_port}/v1/models", timeout=10
    ) as response:
        assert json.loads(response.read())["data"][0]["max_model_len"] == capacity
    started = time.monotonic()
    with system.client() as client:
        with pytest.raises(grpc.RpcError) as refused:
            client.generate(client.request(token_ids=[100] * capacity, max_tokens=4))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        str(capacity) in refused.value.details()
        and str(decode.model_context_tokens) in refused.value.details()
    )
    status, body = _post(
        system,
        "/v1/completions",
        {
            "model": system.system.config.model_name,
            "prompt": [100] * (capacity + 10),
            "max_tokens": 4,
        },
    )
    assert status == 400 and str(capacity) in body, (status, body)
    assert time.monotonic() - started < 5
    # A prompt that fits with max_tokens beyond the cache ends at the served context, never
    # preempting itself.
    with system.client(timeout_s=120) as client:
        done = client.generate(
            client.request(
                token_ids=[100] * (capacity - 40), max_tokens=1000, temperature=0, ignore_eos=True
            )
        )
    assert done.finish_reason == "length" and len(done.token_ids) == 40
    assert _all_free(system, 10)
