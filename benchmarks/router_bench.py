"""What the router adds to streaming: per-token overhead and CPU per streamed token.

Starts a local 1 prefill + 1 decode system (default model, bf16), runs N concurrent greedy streams of
fixed length, and reports, from the same run:
- the client-observed inter-token latency (ITL) percentiles,
- the decode worker's own step time (median over decode-only steps), so that
  router + streaming overhead per token = ITL p50 - decode step p50,
- the router process's CPU seconds per streamed token (the clients run in another process), hence the
  tokens/s one router core sustains.

    .venv/bin/python -m benchmarks.router_bench [--streams 64] [--tokens 64] [--transport ray]
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
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from pdserve.system import ServeConfig, init_ray, start_system

    config = ServeConfig(transport=args.transport, dtype=args.dtype, port=0, max_num_seqs=args.streams)
    init_ray(config)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    system = asyncio.run_coroutine_threadsafe(start_system(config), loop).result(300)
    decode_actor = system.router.decode_pool.workers[0].actor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as clients:  # clients in their own process
        clients.submit(run_streams, system.port, 4, 8).result()  # warm-up
        before = _load(loop, decode_actor)
        cpu_before, wall_before = _cpu_s(), time.monotonic()
        all_stamps = clients.submit(run_streams, system.port, args.streams, args.tokens).result()
        wall_s, cpu_s = time.monotonic() - wall_before, _cpu_s() - cpu_before
        after = _load(loop, decode_actor)
    step_s = (after.decode_steps_s - before.decode_steps_s) / max(1, after.decode_steps - before.decode_steps)
    # ITL within each stream's decode phase (skip the first gap: it spans the KV handoff).
    gaps = [b - a for stamps in all_stamps for a, b in list(zip(stamps, stamps[1:]))[1:] if b > a]
    tokens = sum(len(s) for s in all_stamps)
    result = {
        "streams": args.streams, "tokens_per_stream": args.tokens, "transport": args.transport,
        "tokens": tokens, "wall_s": wall_s, "tokens_per_s": tokens / wall_s,
        "itl_p50_ms": 1e3 * median(gaps), "itl_p99_ms": 1e3 * _percentile(gaps, 0.99),
        "decode_step_mean_ms": 1e3 * step_s, "max_batch": after.max_batch_size_seen,
        "router_overhead_p50_ms": 1e3 * (median(gaps) - step_s),
        "router_cpu_ms_per_token": 1e3 * cpu_s / tokens, "router_tokens_per_cpu_s": tokens / cpu_s,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)
    asyncio.run_coroutine_threadsafe(system.stop(), loop).result(60)


def run_streams(port: int, streams: int, tokens: int) -> list[list[float]]:
    """In the client process: `streams` concurrent greedy streams; each token's arrival time."""
    from pdserve.client import PdserveClient

    def stream(index: int) -> list[float]:
        with PdserveClient(port=port, timeout_s=600) as client:
            request = client.request(f"Story number {index}: once upon a time", max_tokens=tokens,
                                     temperature=0, ignore_eos=True)
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
