"""The fused elementwise kernels (engine/fused_ops.py) against torch's ops in whole engine steps:
one engine, its model's `fused_ops_for` switched off and on between rounds, so both run in the same
minutes of the same process.

    .venv/bin/python -m benchmarks.fused_ops_bench [--dtype float32] [--threads 1] [--rounds 5]

Per round: a fresh 512-token prompt's prefill step, then a decode step of 4 sequences of ~512
tokens (median of 8), each way. Prints the medians over the rounds and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    args = parser.parse_args()

    import torch

    from engine import model as model_module
    from engine.sampling_params import SamplingParams
    from pdserve.planner.profiler import prefill_once, timing_engine

    engine, random_prompt = timing_engine(args.dtype, 16_000, threads=args.threads)
    fused_ops_for = model_module.fused_ops_for
    ways = {"torch's ops": lambda x: None, "fused kernels": fused_ops_for}

    def decode_step_s() -> float:
        for i in range(4):
            params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
            engine.add_request(f"d{time.monotonic_ns()}-{i}", random_prompt(500), params)
        while engine.scheduler.waiting:
            engine.step()
        times = []
        for _ in range(8):
            began = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - began)
        for seq in list(engine.scheduler.running):
            engine.abort(seq.request_id)
        return statistics.median(times)

    results = {name: {"prefill": [], "decode": []} for name in ways}
    try:
        for round_index in range(args.rounds + 1):  # the first round warms up
            # each way first in every other round
            for name in sorted(ways, reverse=bool(round_index % 2)):
                model_module.fused_ops_for = ways[name]
                prefill_s = prefill_once(engine, random_prompt(args.prompt_tokens))
                step_s = decode_step_s()
                if round_index:
                    results[name]["prefill"].append(prefill_s)
                    results[name]["decode"].append(step_s)
    finally:
        model_module.fused_ops_for = fused_ops_for
    print(
        f"cpu {torch.backends.cpu.get_cpu_capability()}, {args.dtype}, {args.threads} thread(s), "
        f"{args.rounds} rounds"
    )
    medians = {
        name: {kind: statistics.median(times) * 1e3 for kind, times in kinds.items()}
        for name, kinds in results.items()
    }
    for kind, label in [("prefill", f"prefill of {args.prompt_tokens}"), ("decode", "decode x4")]:
        before, after = medians["torch's ops"][kind], medians["fused kernels"][kind]
        print(f"{label}: torch's ops {before:.1f} ms, fused {after:.1f} ms ({before / after:.3f}x)")


if __name__ == "__main__":
    main()
