"""What the router adds to streaming: per-token overhead and CPU per streamed token.

Starts a local 1 prefill + 1 decode system (default model, bf16), runs N concurrent greedy streams
of fixed length, and reports, from the same run:
- the client-observed inter-token latency (ITL) percentiles,
- the decode worker's own step time (mean over decode-only steps), so that
  router + streaming overhead per token = ITL p50 - decode step mean,
- the router process's CPU seconds per streamed token (the clients run in another process), hence
  the tokens/s one router core sustains.

Each figure is given twice: over the whole run, and over the steady window, while every stream is in
its decode phase (the decode worker runs all N). The whole run mixes in the ramp (prompts arriving
and prefilled while early streams decode at small batches, whose steps are faster) and each
request's set-up; the steady window compares ITL and step time over the same steps.

    .venv/bin/python -m benchmarks.router_bench [--streams 64] [--tokens 64] [--transport ray]
        [--stream-interval 1] [--routing prefix|load]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import resource
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from statistics import median


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--transport", default="ray", choices=["ray", "grpc"])
    parser.add_argument(
        "--routing", default="prefix", choices=["prefix", "load"], help="the router's --routing"
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--stream-interval", type=int, default=1, help="decode tokens per streamed message"
    )
    parser.add_argument(
        "--asyncio-loop", action="store_true", help="serve on asyncio's own loop, not uvloop's"
    )
    parser.add_argument(
        "--sample-every-s",
        type=float,
        default=2.0,
        help="how often the decode worker's step counters are read (each read is a Ray call "
        "from the router process, about 2 ms of its CPU here, counted as the router's)",
    )
    args = parser.parse_args()

    from pdserve.system import ServeConfig, init_ray, new_event_loop, start_system

    config = ServeConfig(
        transport=args.transport,
        dtype=args.dtype,
        port=0,
        max_num_seqs=args.streams,
        stream_interval=args.stream_interval,
        pd_policy="remote",
        routing=args.routing,
    )  # the disaggregated path, as before
    init_ray(config)
    loop = asyncio.new_event_loop() if args.asyncio_loop else new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    system = asyncio.run_coroutine_threadsafe(start_system(config), loop).result(300)
    decode_actor = system.router.decode_pool.workers[0].actor

    # clients in their own process
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as clients:
        clients.submit(run_streams, system.port, 4, 8).result()  # warm-up
        samples: list[_Sample] = []
        sampling = threading.Event()
        sampler = threading.Thread(
            target=_sample,
            args=(loop, decode_actor, samples, sampling, args.sample_every_s),
            daemon=True,
        )
        sampler.start()
        while not samples:
            time.sleep(0.01)
        streams = clients.submit(run_streams, system.port, args.streams, args.tokens)
        all_stamps = streams.result()
        sampling.set()
        sampler.join()
    first, last = samples[0], samples[-1]
    steady = [s for s in samples if s.load.running_requests == args.streams]
    tokens = sum(len(s) for s in all_stamps)
    result = {
        "streams": args.streams,
        "tokens_per_stream": args.tokens,
        "transport": args.transport,
        "stream_interval": args.stream_interval,
        "tokens": tokens,
        "wall_s": last.time_s - first.time_s,
        "max_batch": last.load.max_batch_size_seen,
        "whole_run": _figures(all_stamps, first, last),
        "steady": _figures(all_stamps, steady[0], steady[-1]) if len(steady) >= 2 else None,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)
    asyncio.run_coroutine_threadsafe(system.stop(), loop).result(60)


@dataclass
class _Sample:
    time_s: float  # monotonic: the same clock as the clients' stamps (one machine)
    cpu_s: float  # this process's (the router's) CPU time
    load: object  # the decode worker's WorkerLoad


def _sample(loop, actor, samples: list, done: threading.Event, every_s: float) -> None:
    """Polls the decode worker; each poll is a Ray call from this (the router) process, so not too
    often."""
    while True:
        load = _load(loop, actor)
        samples.append(_Sample(time.monotonic(), _cpu_s(), load))
        if done.wait(every_s):
            samples.append(_Sample(time.monotonic(), _cpu_s(), _load(loop, actor)))
            return


def _figures(all_stamps: list[list[float]], start: _Sample, end: _Sample) -> dict:
    """ITL, decode step and router CPU between two samples."""
    # Gaps within each stream's decode phase (not its first: that one spans the KV handoff).
    gaps = [
        b - a
        for stamps in all_stamps
        for a, b in list(zip(stamps, stamps[1:]))[1:]
        if b > a and start.time_s <= a and b <= end.time_s
    ]
    tokens = sum(start.time_s <= t <= end.time_s for stamps in all_stamps for t in stamps)
    steps = end.load.decode_steps - start.load.decode_steps
    step_s = (end.load.decode_steps_s - start.load.decode_steps_s) / max(1, steps)
    cpu_s = end.cpu_s - start.cpu_s
    return {
        "window_s": end.time_s - start.time_s,
        "tokens": tokens,
        "tokens_per_s": tokens / (end.time_s - start.time_s),
        "decode_steps": steps,
        "decode_step_mean_ms": 1e3 * step_s,
        "itl_p50_ms": 1e3 * median(gaps),
        "itl_p99_ms": 1e3 * _percentile(gaps, 0.99),
        "router_overhead_p50_ms": 1e3 * (median(gaps) - step_s),
        "router_cpu_ms_per_token": 1e3 * cpu_s / tokens,
        "router_tokens_per_cpu_s": tokens / cpu_s,
    }


def run_streams(port: int, streams: int, tokens: int) -> list[list[float]]:
    """In the client process: `streams` concurrent greedy streams; each token's arrival time."""
    from pdserve.client import PdserveClient

    def stream(index: int) -> list[float]:
        with PdserveClient(port=port, timeout_s=600) as client:
            request = client.request(
                f"Story number {index}: once upon a time",
                max_tokens=tokens,
                temperature=0,
                ignore_eos=True,
            )
            stamps = []
            for response in client.stream(request):
                stamps.extend([time.monotonic()] * len(response.token_ids))
            return stamps

    with ThreadPoolExecutor(streams) as pool:
        return list(pool.map(stream, range(streams)))


def _load(loop, actor):
    async def get():
        return await actor.load.remote()

    return asyncio.run_coroutine_threadsafe(get(), loop).result(30)


if __name__ == "__main__":
    main()
