"""How the OS divides a node's cores among worker processes (issue #30, the simulator's core
model): engine processes of one torch thread each, every one stepping one kind of step, timed
alone in turn and then all together.

    .venv/bin/python -m benchmarks.core_sharing_bench prefill512,decode4,decode4 [--rounds 4]

A kind is `prefill<N>` (an engine step prefilling a fresh N-token prompt) or `decode<B>` (a decode
step of B sequences of 512-token context). Per process: its mean step alone and together, and the
speed together as a share of its speed alone; then the sum of those shares, the cores' worth of
work the processes got done together. The simulator assumes processor sharing: each of k busy
one-thread workers on c cores runs at min(1, c / k) of its own speed, so the sum is min(k, c).
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time


def _worker(index: int, kind: str, rounds: int, phase_s: float, count: int, barrier, results):
    import torch

    from engine.sampling_params import SamplingParams
    from pdserve.planner.profiler import prefill_once, timing_engine

    torch.set_num_threads(1)
    engine, random_prompt = timing_engine("auto", 40_000, seed=index)
    if kind.startswith("decode"):
        params = SamplingParams(max_tokens=1_000_000, temperature=0, ignore_eos=True)
        for sequence in range(int(kind.removeprefix("decode"))):
            prompt = random_prompt(512)
            blocks = engine.allocator.allocate(engine.allocator.blocks_needed(512))
            engine.start_decode(f"d{sequence}", prompt, prompt[-1], params, blocks)
        step = engine.step
    else:
        tokens = int(kind.removeprefix("prefill"))

        def step():
            prefill_once(engine, random_prompt(tokens))

    for _ in range(3):
        step()
    times: dict[str, list[float]] = {"alone": [], "together": []}
    for _ in range(rounds):
        for phase in [*range(count), "together"]:
            barrier.wait()
            if phase in (index, "together"):
                key = "together" if phase == "together" else "alone"
                end = time.perf_counter() + phase_s
                while time.perf_counter() < end:
                    began = time.perf_counter()
                    step()
                    times[key].append(time.perf_counter() - began)
            barrier.wait()
    results.put((index, kind, times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kinds", help="one step kind per process, e.g. prefill512,decode4")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--phase-s", type=float, default=4.0)
    args = parser.parse_args()
    import torch

    kinds = args.kinds.split(",")
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(len(kinds)), context.Queue()
    processes = [
        context.Process(
            target=_worker,
            args=(i, kind, args.rounds, args.phase_s, len(kinds), barrier, results),
        )
        for i, kind in enumerate(kinds)
    ]
    for process in processes:
        process.start()
    rows = sorted(results.get() for _ in processes)
    for process in processes:
        process.join()
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, {len(kinds)} processes")
    shares = []
    for index, kind, times in rows:
        alone, together = statistics.mean(times["alone"]), statistics.mean(times["together"])
        shares.append(alone / together)
        print(
            f"{index} {kind:>11}: alone {alone * 1e3:7.1f} ms ({len(times['alone'])} steps), "
            f"together {together * 1e3:7.1f} ms ({len(times['together'])}): speed {shares[-1]:.2f}"
        )
    print(f"sum of speeds together: {sum(shares):.2f}")


if __name__ == "__main__":
    main()
