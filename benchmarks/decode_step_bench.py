"""The decode step with and without one engine feature, in one process.

Fills a batch of sequences with random prompts of a fixed context length, then times engine steps
(decode only) alternately with and without the feature, and prints the median step of each, so both
sides share the same machine state. `--compare kernel` (the default): the paged decode-attention
kernel against the torch path (gather + SDPA), or with `--against OLD.c` against the kernel built
from that source (an older engine/csrc/paged_attention.c, its cpu_math.h beside it);
`--compare linear`: fp32 decode batches' linears through engine/csrc/decode_linear.c
(engine/cpu_packing.py, AVX2 machines) against MKL on the same transposed weights;
`--compare mapped` (fp32): the transposed weights memory-mapped from the disk cache, as workers
serve them, against copies of them in the process's own memory; `--compare logprobs`: every sequence
asking for logprobs with `--top-logprobs` alternatives (20, the most a request may ask) against none
asking; `--compare guided`: every sequence under a JSON schema's grammar (engine/guided.py: its
token mask computed and applied at each step; a fresh matcher each round, so answers stay mid-JSON)
against none, and the mask computation's own time per step.

    .venv/bin/python -m benchmarks.decode_step_bench [--threads 1] [--context 540]
        [--batches 1,8,16]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

# Mid-JSON through the timed steps: strings and arrays the model keeps filling.
_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "cities": {"type": "array", "items": {"type": "string"}},
        "notes": {"type": "string"},
    },
    "required": ["name", "age", "cities", "notes"],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=540, help="prompt tokens per sequence")
    parser.add_argument("--batches", default="1,8,16")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=4, help="alternations of the two paths")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per path per round")
    parser.add_argument(
        "--compare",
        choices=["kernel", "linear", "mapped", "logprobs", "guided"],
        default="kernel",
    )
    parser.add_argument(
        "--against", type=Path, help="--compare kernel: another paged_attention.c, not torch's path"
    )
    parser.add_argument(
        "--top-logprobs", type=int, default=20, help="--compare logprobs: alternatives per token"
    )
    args = parser.parse_args()

    import dataclasses

    import torch

    from engine.cpu_packing import TransposedLinear
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.paged_attention import PagedDecodeAttention, build, load_kernel
    from engine.sampling_params import GuidedDecoding, SamplingParams

    torch.set_num_threads(args.threads)
    if args.compare == "mapped":
        from engine.weights import load_model

        # writes the disk cache's serving entry if it is not there
        load_model("default", torch.float32)
    engine = LLMEngine(
        EngineConfig(
            model="default",
            dtype=args.dtype,
            num_threads=args.threads,
            kv_cache_bytes=2 << 30,
            detokenize=False,
        )
    )
    kernel = load_kernel()
    if kernel is None:
        raise SystemExit("the kernel is not available here (no C compiler?): nothing to compare")
    baseline = PagedDecodeAttention(build(source=args.against)) if args.against else None
    layers = [m for m in engine.loaded.model.modules() if isinstance(m, TransposedLinear)]
    linear_kernels = [m.decode for m in layers]
    if args.compare == "linear" and not any(k is not None for k in linear_kernels):
        raise SystemExit(
            "no decode linear kernel here (fp32 on an AVX2 CPU only): nothing to compare"
        )
    mapped = [m.weight_t for m in layers]
    copies = [w.clone() for w in mapped] if args.compare == "mapped" else []

    guided = GuidedDecoding(json_schema=json.dumps(_SCHEMA))
    mask_s = []  # the guided rows' mask computation, per step

    def use(on: bool) -> None:
        if args.compare == "guided":
            for seq in engine.scheduler.running:
                seq.params = dataclasses.replace(seq.params, guided=guided if on else None)
                seq.matcher = engine._matcher(seq.params, []) if on else None
            if on and not hasattr(engine._masks, "timed"):
                compute = engine._masks.compute

                def timed(matchers):
                    started = time.perf_counter()
                    allowed = compute(matchers)
                    mask_s.append(time.perf_counter() - started)
                    return allowed

                engine._masks.compute, engine._masks.timed = timed, True
            return
        if args.compare == "logprobs":
            for seq in engine.scheduler.running:
                seq.params = dataclasses.replace(
                    seq.params, logprobs=args.top_logprobs if on else None
                )
            return
        if args.compare == "kernel":
            engine.loaded.model.use_decode_kernel(kernel if on else baseline)
            return
        if args.compare == "mapped":
            for layer, weight in zip(layers, mapped if on else copies):
                layer.weight_t = weight
            return
        for layer, linear in zip(layers, linear_kernels):
            layer.decode = linear if on else None

    before, after = {
        "kernel": (
            f"kernel of {args.against}" if args.against else "torch (gather + SDPA)",
            "paged kernel",
        ),
        "linear": ("MKL", "decode linear kernel"),
        "mapped": ("own memory", "mapped"),
        "logprobs": ("no logprobs", "logprobs"),
        "guided": ("free", "guided"),
    }[args.compare]
    paths = {before: False, after: True}
    generator = torch.Generator().manual_seed(0)
    max_tokens = 2 + args.rounds * len(paths) * args.steps
    print(
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}, threads {args.threads}, "
        f"{args.dtype}, {args.context}-token contexts; median decode step:"
    )
    for batch in (int(b) for b in args.batches.split(",")):
        ids = [f"b{batch}-{i}" for i in range(batch)]
        for request_id in ids:
            prompt = torch.randint(100, 40000, (args.context,), generator=generator).tolist()
            engine.add_request(
                request_id,
                prompt,
                SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0),
            )
        while engine.scheduler.waiting:  # prefill everything first
            engine.step()
        engine.step()
        samples = {name: [] for name in paths}
        mask_s.clear()
        for _ in range(args.rounds):
            for name, path in paths.items():
                use(path)
                for _ in range(args.steps):
                    started = time.perf_counter()
                    engine.step()
                    samples[name].append(time.perf_counter() - started)
        use(True)
        medians = {name: sorted(values)[len(values) // 2] * 1e3 for name, values in samples.items()}
        change = (
            ""
            if args.compare not in ("logprobs", "guided")
            else f" (cost {medians[after] / medians[before] - 1:+.1%})"
        )
        if mask_s:
            mask_ms = sorted(mask_s)[len(mask_s) // 2] * 1e3
            change += f", mask computation {mask_ms:.2f} ms ({mask_ms / medians[before]:.1%})"
        print(
            f"  batch {batch:3d}: {before} {medians[before]:7.1f} ms, {after} "
            f"{medians[after]:7.1f} ms, {medians[before] / medians[after]:.2f}x{change}"
        )
        for request_id in ids:
            engine.abort(request_id)


if __name__ == "__main__":
    main()
