"""How the router hands a decode worker's chunks to a request's stream, without Ray: only the worker
holding the request feeds it; a backlog leaves as one chunk; `stream_interval` groups decode tokens;
the token stream's wire format and subscription (a real gRPC server standing in for the
worker's)."""

import asyncio
import math
import queue
import time
from concurrent import futures
from types import SimpleNamespace

import grpc
import msgpack
import pytest

from protocol.messages import WorkerCosts, WorkerInfo
from protocol.token_stream import (
    OUTPUT_STREAM_SERVICE,
    OUTPUT_STREAM_VERSION,
    TokenChunk,
    decode_chunks,
    encode_chunks,
)
from router.chunks import read_chunks
from router.failures import WorkerError, WorkerLost
from router.pools import WorkerHandle
from router.registry import Registry, Route
from router.router import RouterConfig
from router.token_stream import TokenStreams
from router.worker_client import WorkerClient


class _Intake:
    """The router's parts that hand a decode worker's chunks to a request: its token streams, its
    registry (an attempt's route and inbox) and the chunk reader, as `Router` composes them."""

    def __init__(self, stream_interval: int = 1):
        self.streams = TokenStreams()
        self.client = WorkerClient()
        self.registry = Registry(self.streams, self.client)
        self.stream_interval = stream_interval

    def track(self, request_id: str, holder: WorkerHandle) -> Route:
        """A request admitted and its attempt held by `holder` (on the running loop)."""
        return self.registry.track(self.registry.claim(request_id), request_id, None, holder)

    def chunks(self, route: Route, coalesce: bool = True):
        return read_chunks(route, self.client, self.stream_interval, coalesce)


def _worker(worker_id: str) -> WorkerHandle:
    return WorkerHandle(
        actor=None, info=WorkerInfo(worker_id, "decode", "node", None, 64, 2048, 100)
    )


def _collect(
    intake: _Intake, holder: WorkerHandle, deliveries, coalesce: bool = True
) -> list[TokenChunk]:
    """On a loop, as in the router: track a request held by `holder`, deliver (worker, chunks)
    pairs, and collect what its consumer gets."""

    async def run():
        route = intake.track("req", holder)
        for worker, chunks in deliveries:
            intake.streams.deliver(worker, chunks)
        return [chunk async for chunk in intake.chunks(route, coalesce)]

    return asyncio.run(run())


def test_chunks_from_a_worker_that_no_longer_holds_the_request_are_dropped():
    intake = _Intake()
    handed_back, holder = _worker("decode-0"), _worker("decode-1")
    # decode-0 had a reservation under the same id, handed back: its abort notice must not end the
    # request
    chunks = _collect(
        intake,
        holder,
        [
            (handed_back, [TokenChunk("req", (), finish_reason="abort")]),
            (holder, [TokenChunk("req", (7,)), TokenChunk("req", (8,), finish_reason="length")]),
        ],
    )
    assert [c.token_ids for c in chunks] == [(7, 8)] and chunks[-1].finish_reason == "length"


def test_a_backlog_leaves_as_one_chunk_but_not_for_requests_with_stop_strings():
    for coalesce, expected in ((True, [(1, 2, 3)]), (False, [(1,), (2,), (3,)])):
        intake = _Intake()
        worker = _worker("decode-0")
        chunks = _collect(
            intake,
            worker,
            [
                (
                    worker,
                    [
                        TokenChunk("req", (1,), kv_ready_wall_s=5.0),
                        TokenChunk("req", (2,)),
                        TokenChunk("req", (3,), finish_reason="stop"),
                    ],
                )
            ],
            coalesce,
        )
        assert [c.token_ids for c in chunks] == expected
        assert chunks[0].kv_ready_wall_s == 5.0 and chunks[-1].finish_reason == "stop"


def test_stream_interval_holds_decode_tokens_but_not_the_first_chunk_nor_the_last():
    async def run():
        intake = _Intake(stream_interval=3)
        worker = _worker("decode-0")
        route = intake.track("req", worker)
        received: list[tuple[int, ...]] = []

        async def consume():
            async for chunk in intake.chunks(route):
                received.append(chunk.token_ids)

        consumer = asyncio.get_running_loop().create_task(consume())
        for token in range(1, 8):  # one step at a time, the consumer keeping up
            intake.streams.deliver(
                worker,
                [TokenChunk("req", (token,), finish_reason="length" if token == 7 else None)],
            )
            await asyncio.sleep(0.01)
        await asyncio.wait_for(consumer, 5)
        return received

    assert asyncio.run(run()) == [(1,), (2, 3, 4), (5, 6, 7)]


def test_a_worker_lost_mid_interval_still_hands_over_the_tokens_held_back_first():
    async def run():
        intake = _Intake(stream_interval=4)
        worker = _worker("decode-0")
        route = intake.track("req", worker)
        intake.streams.deliver(worker, [TokenChunk("req", (1,))])
        received = []
        with pytest.raises(WorkerLost, match="decode-0 died"):
            async for chunk in intake.chunks(route):
                received.append(chunk.token_ids)
                if len(received) == 1:
                    intake.streams.deliver(
                        worker, [TokenChunk("req", (2,)), TokenChunk("req", (3,))]
                    )
                    intake.streams.inbox("req").put_nowait(
                        WorkerLost(worker, "its output stream ended")
                    )
        return received

    # the loss is raised only after the two held-back tokens went out: migration re-runs exactly
    # what the client has seen
    assert asyncio.run(run()) == [(1,), (2, 3)]


def test_a_stream_interval_below_one_is_refused():
    with pytest.raises(ValueError, match="stream_interval"):
        RouterConfig("disaggregated", stream_interval=0)


def test_token_chunks_cross_the_wire_with_every_field():
    chunks = [
        TokenChunk("a", (1, 2), "stop", None, 1.5, 4),
        TokenChunk("b", (), None, "KV transfer failed: x"),
        TokenChunk("c", (3,)),
        TokenChunk("d", (4,), "length", decode_step_s=0.041),
    ]
    assert decode_chunks(encode_chunks(chunks)) == (chunks, [], WorkerCosts())
    events = [(True, b"\x01" * 16), (False, b"\x02" * 16)]
    # the worker's costs after the step travel with it, "nothing decodes" (an infinite slack) too
    for costs in (WorkerCosts(0.0009, 0.031, 0.25, 256), WorkerCosts(0.001, None, math.inf)):
        assert decode_chunks(encode_chunks(chunks, events, costs)) == (chunks, events, costs)


class _TokenServer:
    """A stand-in for a decode worker's output stream: sends the hello it is given, then what the
    test puts on `steps` (bytes of encoded chunks; None ends the stream)."""

    def __init__(self, hello: list):
        self.steps: queue.Queue = queue.Queue()

        def subscribe(request, context):
            if dict(context.invocation_metadata()).get("authorization") != "s3cret":
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong secret")
            yield msgpack.packb(hello)
            while (step := self.steps.get()) is not None:
                yield step

        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        handler = grpc.unary_stream_rpc_method_handler(subscribe)
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(OUTPUT_STREAM_SERVICE, {"Subscribe": handler}),)
        )
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def stop(self) -> None:
        # a handler still waiting returns (its pool thread would block the exit)
        self.steps.put(None)
        self.server.stop(None)

    def worker(self, worker_id: str) -> WorkerHandle:
        async def output_address():
            return self.address, "s3cret"

        actor = SimpleNamespace(output_address=SimpleNamespace(remote=output_address))
        return WorkerHandle(
            actor=actor, info=WorkerInfo(worker_id, "decode", "node", None, 64, 2048, 100)
        )


@pytest.fixture
def token_server():
    """Starts `_TokenServer`s that say they are the given worker; stops them after the test."""
    servers = []

    def start(worker_id: str) -> _TokenServer:
        servers.append(_TokenServer([OUTPUT_STREAM_VERSION, worker_id]))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


async def _subscribed(server: _TokenServer) -> tuple[_Intake, WorkerHandle]:
    """The router's parts subscribed to the server's stream, as to a decode worker "decode-0"."""
    intake = _Intake()
    worker = server.worker("decode-0")
    await intake.streams.watch(worker)
    return intake, worker


def test_steps_arriving_during_a_loop_stall_are_handed_out_together_then_the_end_fails_requests(
    token_server,
):
    server = token_server("decode-0")

    async def run():
        intake, worker = await _subscribed(server)
        route = intake.track("req", worker)
        received = []

        async def consume():
            async for chunk in intake.chunks(route):
                received.append(chunk.token_ids)

        consumer = asyncio.get_running_loop().create_task(consume())
        server.steps.put(encode_chunks([TokenChunk("req", (1,))]))
        while not received:
            await asyncio.sleep(0.01)
        for token in range(2, 6):
            server.steps.put(encode_chunks([TokenChunk("req", (token,))]))
            server.steps.put(encode_chunks([]))  # a heartbeat: nothing to hand out
        time.sleep(1.0)  # the loop is stalled; the subscription's reader goes on
        await asyncio.sleep(0.2)
        server.steps.put(None)  # the worker goes away
        with pytest.raises(WorkerLost, match="decode-0"):
            await asyncio.wait_for(consumer, 10)
        return received, worker.state

    assert asyncio.run(run()) == ([(1,), (2, 3, 4, 5)], "dead")


def test_a_token_stream_that_answers_for_another_worker_is_refused(token_server):
    server = token_server("decode-7")
    with pytest.raises(WorkerError, match="decode-7"):
        asyncio.run(_Intake().streams.watch(server.worker("decode-0")))


def test_a_steps_messages_are_all_prepared_before_the_first_is_written(token_server):
    server = token_server("decode-0")

    async def run():
        intake, worker = await _subscribed(server)
        log = []

        async def consume(request_id: str):  # what a frontend does per message
            async for chunk in intake.chunks(intake.track(request_id, worker)):
                log.append(("prepared", request_id))
                await intake.streams.writes_released()
                log.append(("written", request_id))

        consumers = [asyncio.get_running_loop().create_task(consume(r)) for r in "abc"]
        await asyncio.sleep(0.1)
        server.steps.put(
            encode_chunks([TokenChunk(r, (1,), finish_reason="length") for r in "abc"])
        )
        await asyncio.wait_for(asyncio.gather(*consumers), 10)
        return log

    assert asyncio.run(run()) == [("prepared", r) for r in "abc"] + [("written", r) for r in "abc"]


def test_a_requests_last_chunk_carries_the_mean_of_its_own_decode_steps():
    """The decode worker's `_decode_step_s` on a stub loop: a request's mean engine decode step from
    its first decoded token on, whoever else finishes in the same step (they leave `running` before
    any output is handled); the loop hook forgets requests the engine no longer holds."""
    from decode_worker.worker import DecodeWorker

    loop = SimpleNamespace(decode_steps=0, decode_steps_s=0.0, last_step_s=0.0)
    scheduler = SimpleNamespace(running=[], waiting=[])
    engine = SimpleNamespace(last_step_was_prefill=False, scheduler=scheduler)
    worker = SimpleNamespace(loop=loop, engine=engine, _decode_from={})

    def step(seconds, outputs):
        loop.decode_steps += 1
        loop.decode_steps_s += seconds
        loop.last_step_s = seconds
        return [
            DecodeWorker._decode_step_s(worker, SimpleNamespace(request_id=r, finished=done))
            for r, done in outputs
        ]

    assert step(0.010, [("a", False), ("b", False)]) == [None, None]
    assert step(0.020, [("a", False), ("b", False), ("c", False)]) == [None] * 3
    assert step(0.030, [("a", True), ("b", True), ("c", True)]) == pytest.approx(
        [0.020, 0.020, 0.025]
    )
    assert step(0.040, [("d", True)]) == pytest.approx([0.040])  # one decode step only
    assert worker._decode_from == {}
    step(0.010, [("e", False), ("f", False)])
    scheduler.running = [SimpleNamespace(request_id="e")]  # f failed with an engine step
    DecodeWorker._forget_gone_decodes(worker)
    assert set(worker._decode_from) == {"e"}
