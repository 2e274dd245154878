"""The decode step with and without the paged decode-attention kernel, in one process.

Fills a batch of sequences with random prompts of a fixed context length, then times engine steps
(decode only) alternately with the kernel and with the torch path (gather + SDPA), and prints the
median step of each, so both sides share the same machine state.

    .venv/bin/python -m benchmarks.decode_step_bench [--threads 1] [--context 540] [--batches 1,8,16]
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=540, help="prompt tokens per sequence")
    parser.add_argument("--batches", default="1,8,16")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=4, help="alternations of the two paths")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per path per round")
    args = parser.parse_args()

    import torch

    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.paged_attention import load_kernel
    from engine.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model="default", dtype=args.dtype, num_threads=args.threads,
                                    kv_cache_bytes=2 << 30, detokenize=False))
    kernel = load_kernel()
    if kernel is None:
        raise SystemExit("the kernel is not available here (no C compiler?): nothing to compare")
    paths = {"torch (gather + SDPA)": None, "paged kernel": kernel}
    generator = torch.Generator().manual_seed(0)
    max_tokens = 2 + args.rounds * len(paths) * args.steps
    print(f"threads {args.threads}, {args.dtype}, {args.context}-token contexts; median decode step:")
    for batch in (int(b) for b in args.batches.split(",")):
        ids = [f"b{batch}-{i}" for i in range(batch)]
        for request_id in ids:
            prompt = torch.randint(100, 40000, (args.context,), generator=generator).tolist()
            engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))
        while engine.scheduler.waiting:  # prefill everything first
            engine.step()
        engine.step()
        samples = {name: [] for name in paths}
        for _ in range(args.rounds):
            for name, path in paths.items():
                engine.loaded.model.use_decode_kernel(path)
                for _ in range(args.steps):
                    started = time.perf_counter()
                    engine.step()
                    samples[name].append(time.perf_counter() - started)
        engine.loaded.model.use_decode_kernel(kernel)
        medians = {name: sorted(values)[len(values) // 2] * 1e3 for name, values in samples.items()}
        before, after = medians["torch (gather + SDPA)"], medians["paged kernel"]
        print(f"  batch {batch:3d}: torch {before:7.1f} ms, kernel {after:7.1f} ms, {before / after:.2f}x")
        for request_id in ids:
            engine.abort(request_id)


if __name__ == "__main__":
    main()
