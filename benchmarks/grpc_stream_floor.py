"""The floor under the router's per-token cost: CPU per message of a bare grpc.aio server-streaming
handler that does nothing but wait on an asyncio queue and yield a small `GenerateResponse`, with
the router benchmark's shape (N concurrent streams, one message each per tick, clients in another
process).

    .venv/bin/python -m benchmarks.grpc_stream_floor [--streams 64] [--messages 128] [--tick-ms 130]
        [--asyncio-loop]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import resource
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _serve(tick_s: float, ready: Future, done: threading.Event) -> None:
    import grpc

    from pdserve_proto import pdserve_pb2 as pb, pdserve_pb2_grpc as pb_grpc

    ticks: list[asyncio.Queue] = []

    class Servicer(pb_grpc.GenerationServicer):
        async def Generate(self, request, context):
            queue: asyncio.Queue = asyncio.Queue()
            ticks.append(queue)
            for index in range(request.sampling.max_tokens):
                await queue.get()
                yield pb.GenerateResponse(
                    request_id=request.request_id, token_ids=[index], text=" token"
                )

    server = grpc.aio.server()
    pb_grpc.add_GenerationServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ready.set_result(port)
    while not done.is_set():
        await asyncio.sleep(tick_s)
        for queue in ticks:
            queue.put_nowait(None)
    await server.stop(0)


def _clients(port: int, streams: int, messages: int) -> int:
    import grpc

    from pdserve_proto import pdserve_pb2 as pb, pdserve_pb2_grpc as pb_grpc

    def one(index: int) -> int:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            request = pb.GenerateRequest(
                request_id=f"r{index}", text="x", sampling=pb.SamplingParams(max_tokens=messages)
            )
            return sum(1 for _ in pb_grpc.GenerationStub(channel).Generate(request))

    with ThreadPoolExecutor(streams) as pool:
        return sum(pool.map(one, range(streams)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--messages", type=int, default=128)
    parser.add_argument("--tick-ms", type=float, default=130.0)
    parser.add_argument(
        "--asyncio-loop", action="store_true", help="asyncio's own loop, not uvloop's"
    )
    args = parser.parse_args()

    from pdserve.system import new_event_loop

    loop = asyncio.new_event_loop() if args.asyncio_loop else new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    done = threading.Event()
    ready: Future = Future()
    serving = asyncio.run_coroutine_threadsafe(_serve(args.tick_ms / 1e3, ready, done), loop)
    port = ready.result(timeout=30)
    with multiprocessing.get_context("spawn").Pool(1) as clients:
        cpu_before, wall_before = _cpu_s(), time.monotonic()
        received = clients.apply(_clients, (port, args.streams, args.messages))
        cpu_s, wall_s = _cpu_s() - cpu_before, time.monotonic() - wall_before
    done.set()
    serving.result(timeout=30)
    print(
        json.dumps(
            {
                "loop": "asyncio" if args.asyncio_loop else type(loop).__module__.split(".")[0],
                "streams": args.streams,
                "messages": received,
                "wall_s": round(wall_s, 2),
                "server_cpu_ms_per_message": round(1e3 * cpu_s / received, 4),
                "messages_per_cpu_s": round(received / cpu_s),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
