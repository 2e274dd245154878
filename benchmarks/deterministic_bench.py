"""`--deterministic` against the default kernels, in one process: a 512-token prefill step and the
decode step at a few batch sizes (context 540), the two engines alternated in rounds (A/B/A), so
both see the same machine state; medians. Records the CPU's capability.

    .venv/bin/python -m benchmarks.deterministic_bench [--dtype bfloat16] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
from engine.weights import load_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", default="1,8,16")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"capability {torch.backends.cpu.get_cpu_capability()}, dtype {args.dtype}, "
        f"threads {args.threads}"
    )
    dtype = getattr(torch, args.dtype)
    loaded = {det: load_model("default", dtype, deterministic=det) for det in (False, True)}
    generator = torch.Generator().manual_seed(0)

    def prompt(tokens: int) -> list[int]:
        return torch.randint(100, 40000, (tokens,), generator=generator).tolist()

    def engine(det: bool) -> LLMEngine:
        config = EngineConfig(
            dtype=args.dtype,
            deterministic=det,
            kv_cache_bytes=512 << 20,
            enable_prefix_caching=False,
            max_num_batched_tokens=1024,
        )
        return LLMEngine(config, loaded=loaded[det])

    engines = {det: engine(det) for det in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    tokens = prompt(512)
    for r in range(args.rounds):
        for det in (False, True, False) if r % 2 == 0 else (True, False, True):
            one = engines[det]
            one.add_request(f"p{r}-{det}-{len(times[det])}", tokens, SamplingParams(max_tokens=1))
            start = time.perf_counter()
            one.step()
            times[det].append(time.perf_counter() - start)
            while one.has_unfinished():
                one.step()
    for det in (False, True):
        print(
            f"prefill 512 tokens, deterministic={det}: {statistics.median(times[det]) * 1e3:.1f} ms"
        )
    for batch in (int(b) for b in args.batches.split(",")):
        engines = {det: engine(det) for det in (False, True)}
        prompts = [prompt(540) for _ in range(batch)]
        for one in engines.values():
            for i, p in enumerate(prompts):
                params = SamplingParams(max_tokens=10_000, ignore_eos=True)
                one.add_request(f"b{batch}-{i}", p, params)
            while one.scheduler.waiting:
                one.step()
            for _ in range(3):
                one.step()
        steps: dict[bool, list[float]] = {False: [], True: []}
        for r in range(args.rounds):
            for det in (False, True) if r % 2 == 0 else (True, False):
                for _ in range(5):
                    start = time.perf_counter()
                    engines[det].step()
                    steps[det].append(time.perf_counter() - start)
        for det in (False, True):
            median_ms = statistics.median(steps[det]) * 1e3
            print(f"decode step, batch {batch}, deterministic={det}: {median_ms:.2f} ms")


if __name__ == "__main__":
    main()
