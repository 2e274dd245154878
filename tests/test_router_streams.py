"""How the router hands a decode worker's chunks to a request's stream, without Ray: only the worker
holding the request feeds it; a backlog leaves as one chunk; `stream_interval` groups decode tokens."""

import asyncio

import pytest

from engine.worker_messages import TokenChunk, WorkerInfo
from router.pool import WorkerHandle, WorkerPool
from router.router import Router, RouterConfig, WorkerLost


def _router(stream_interval: int = 1) -> Router:
    config = RouterConfig("disaggregated", stream_interval=stream_interval)
    return Router(config, None, WorkerPool("prefill"), WorkerPool("decode"))


def _worker(worker_id: str) -> WorkerHandle:
    return WorkerHandle(actor=None, info=WorkerInfo(worker_id, "decode", "node", None, 64, 2048, 100))


def _collect(router: Router, route, coalesce: bool = True) -> list[TokenChunk]:
    async def run():
        return [chunk async for chunk in router._chunks(route, coalesce)]

    return asyncio.run(run())


def test_chunks_from_a_worker_that_no_longer_holds_the_request_are_dropped():
    router = _router()
    handed_back, holder = _worker("decode-0"), _worker("decode-1")
    route = router._track("req", "req", None, holder)
    # decode-0 had a reservation under the same id, handed back: its abort notice must not end the request
    router._deliver(handed_back, [TokenChunk("req", (), finish_reason="abort")])
    router._deliver(holder, [TokenChunk("req", (7,)), TokenChunk("req", (8,), finish_reason="length")])
    chunks = _collect(router, route)
    assert [c.token_ids for c in chunks] == [(7, 8)] and chunks[-1].finish_reason == "length"


def test_a_backlog_leaves_as_one_chunk_but_not_for_requests_with_stop_strings():
    for coalesce, expected in ((True, [(1, 2, 3)]), (False, [(1,), (2,), (3,)])):
        router = _router()
        worker = _worker("decode-0")
        route = router._track("req", "req", None, worker)
        router._deliver(worker, [TokenChunk("req", (1,), kv_ready_wall_s=5.0), TokenChunk("req", (2,)),
                                 TokenChunk("req", (3,), finish_reason="stop")])
        chunks = _collect(router, route, coalesce)
        assert [c.token_ids for c in chunks] == expected
        assert chunks[0].kv_ready_wall_s == 5.0 and chunks[-1].finish_reason == "stop"


def test_stream_interval_holds_decode_tokens_but_not_the_first_chunk_nor_the_last():
    async def run():
        router = _router(stream_interval=3)
        worker = _worker("decode-0")
        route = router._track("req", "req", None, worker)
        received: list[tuple[int, ...]] = []

        async def consume():
            async for chunk in router._chunks(route):
                received.append(chunk.token_ids)

        consumer = asyncio.get_running_loop().create_task(consume())
        for token in range(1, 8):  # one step at a time, the consumer keeping up
            router._deliver(worker, [TokenChunk("req", (token,), finish_reason="length" if token == 7 else None)])
            await asyncio.sleep(0.01)
        await asyncio.wait_for(consumer, 5)
        return received

    assert asyncio.run(run()) == [(1,), (2, 3, 4), (5, 6, 7)]


def test_a_worker_lost_mid_interval_still_hands_over_the_tokens_held_back_first():
    async def run():
        router = _router(stream_interval=4)
        worker = _worker("decode-0")
        route = router._track("req", "req", None, worker)
        router._deliver(worker, [TokenChunk("req", (1,))])
        received = []
        with pytest.raises(WorkerLost, match="decode-0 died"):
            async for chunk in router._chunks(route):
                received.append(chunk.token_ids)
                if len(received) == 1:
                    router._deliver(worker, [TokenChunk("req", (2,)), TokenChunk("req", (3,))])
                    router._streams["req"][1].put_nowait(WorkerLost(worker, "its output stream ended"))
        return received

    # the loss is raised only after the two held-back tokens went out: migration re-runs exactly what the
    # client has seen
    assert asyncio.run(run()) == [(1,), (2, 3)]


def test_a_stream_interval_below_one_is_refused():
    with pytest.raises(ValueError, match="stream_interval"):
        RouterConfig("disaggregated", stream_interval=0)
