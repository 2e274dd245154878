"""Our engine against HF transformers (the reference), side by side in one run on this machine.

    .venv/bin/python -m benchmarks.engine_bench [--dtypes bfloat16,float32] [--repeats 3]
        [--json out.json]
    .venv/bin/python -m benchmarks.engine_bench --quick      # smoke test: 1 repeat, bfloat16 only

Per dtype, both engines hold the same weights (the default GGUF, dequantized) and run with
`torch.set_num_threads(2)`. Each repeat draws fresh random prompt ids (fixed seed), so nothing can
be reused from a cache, and runs every measurement on both engines, alternating which goes first:

  TTFT        a single fresh request of 128 / 512 / 1024 tokens until its first token.
  TPOT        one stream, 128-token prompt, 128 greedy output tokens ignoring EOS:
              (e2e - ttft) / (n_out - 1), both taken inside the same request.
  throughput  16 concurrent requests of 256 -> 128 tokens (greedy, ignoring EOS): output tokens /
  wall.

How HF is driven: TTFT is one `model(ids, logits_to_keep=1)` forward plus argmax (what `generate`
does for its first token); TPOT is one `generate(max_new_tokens=min_new_tokens=128)` call whose
streamer timestamps the first token; throughput is `generate` over a [16, 256] batch (equal lengths,
no padding). Ours: `add_request` then `step()` until the request (or all 16) finish.
Reported numbers are medians over the repeats; the JSON file also holds every sample.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# transformers' GGUF loader draws its progress bar with tqdm directly
os.environ.setdefault("TQDM_DISABLE", "1")

import torch

NUM_THREADS = 2
TTFT_PROMPT_TOKENS = (128, 512, 1024)
STREAM_PROMPT_TOKENS, STREAM_OUTPUT_TOKENS = 128, 128
BATCH_SIZE, BATCH_PROMPT_TOKENS, BATCH_OUTPUT_TOKENS = 16, 256, 128
PROMPT_TOKEN_RANGE = (100, 40000)  # ordinary vocabulary ids, clear of the special tokens
SEED = 1234
METRICS = [f"ttft_{n}_ms" for n in TTFT_PROMPT_TOKENS] + ["tpot_ms", "throughput_tok_s"]
HEADERS = [f"TTFT {n}" for n in TTFT_PROMPT_TOKENS] + [
    "TPOT, one stream",
    f"{BATCH_SIZE} x ({BATCH_PROMPT_TOKENS} in → {BATCH_OUTPUT_TOKENS} out), output tok/s",
]


@dataclass
class StreamTiming:
    ttft_s: float
    e2e_s: float
    num_output_tokens: int

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


class OurEngine:
    name = "pdserve engine"

    def __init__(self, dtype: str):
        from engine.dtypes import parse_dtype
        from engine.llm_engine import EngineConfig, LLMEngine
        from engine.weights import load_model

        loaded = load_model("default", parse_dtype(dtype))
        block_size_tokens = 16
        blocks_per_seq = -(-(BATCH_PROMPT_TOKENS + BATCH_OUTPUT_TOKENS) // block_size_tokens) + 1
        kv_cache_bytes = (
            BATCH_SIZE
            * blocks_per_seq
            * block_size_tokens
            * loaded.config.kv_bytes_per_token(parse_dtype(dtype))
        )
        config = EngineConfig(
            model="default",
            dtype=dtype,
            num_threads=NUM_THREADS,
            enable_prefix_caching=False,
            block_size_tokens=block_size_tokens,
            kv_cache_bytes=kv_cache_bytes,
            max_num_seqs=BATCH_SIZE,
        )
        self.engine = LLMEngine(config, loaded)
        self._next_id = 0

    def _add(self, prompt_ids: list[int], max_tokens: int) -> str:
        from engine.sampling import SamplingParams

        self._next_id += 1
        request_id = f"bench-{self._next_id}"
        self.engine.add_request(
            request_id,
            prompt_ids,
            SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        )
        return request_id

    def first_token(self, prompt_ids: list[int]) -> tuple[float, int]:
        start = time.perf_counter()
        self._add(prompt_ids, max_tokens=1)
        while not (outputs := self.engine.step()):
            pass
        return time.perf_counter() - start, outputs[0].new_token_ids[0]

    def stream(self, prompt_ids: list[int], num_output_tokens: int) -> StreamTiming:
        start = time.perf_counter()
        self._add(prompt_ids, num_output_tokens)
        first_s: Optional[float] = None
        count = 0
        while self.engine.has_unfinished():
            for output in self.engine.step():
                count += len(output.new_token_ids)
                if first_s is None:
                    first_s = time.perf_counter() - start
        return StreamTiming(first_s, time.perf_counter() - start, count)

    def batch(self, prompts: list[list[int]], num_output_tokens: int) -> tuple[int, float]:
        start = time.perf_counter()
        for prompt_ids in prompts:
            self._add(prompt_ids, num_output_tokens)
        count = 0
        while self.engine.has_unfinished():
            count += sum(len(output.new_token_ids) for output in self.engine.step())
        return count, time.perf_counter() - start


class _FirstTokenClock:
    """A `generate` streamer: its first `put` is the prompt, its second the first new token."""

    def __init__(self, start: float):
        self.start, self.num_puts, self.first_s = start, 0, None

    def put(self, value) -> None:
        self.num_puts += 1
        if self.num_puts == 2:
            self.first_s = time.perf_counter() - self.start

    def end(self) -> None:
        pass


class HFReference:
    name = "HF transformers"

    def __init__(self, dtype: str):
        import transformers

        from engine.default_model import default_model_path
        from engine.dtypes import parse_dtype
        from tests.hf_reference import hf_model

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        # transformers' dense reading of the GGUF file (dequantized, converted once), in `dtype`,
        # like ours
        self.model = hf_model(default_model_path(), parse_dtype(dtype))
        self.pad_token_id = self.model.generation_config.eos_token_id
        if isinstance(self.pad_token_id, list):
            self.pad_token_id = self.pad_token_id[0]

    def _generate(
        self, input_ids: torch.Tensor, num_output_tokens: int, streamer=None
    ) -> torch.Tensor:
        return self.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=num_output_tokens,
            min_new_tokens=num_output_tokens,
            do_sample=False,
            pad_token_id=self.pad_token_id,
            streamer=streamer,
        )

    @torch.inference_mode()
    def first_token(self, prompt_ids: list[int]) -> tuple[float, int]:
        start = time.perf_counter()
        logits = self.model(torch.tensor([prompt_ids]), logits_to_keep=1).logits
        token = int(logits[0, -1].argmax())
        return time.perf_counter() - start, token

    @torch.inference_mode()
    def stream(self, prompt_ids: list[int], num_output_tokens: int) -> StreamTiming:
        start = time.perf_counter()
        clock = _FirstTokenClock(start)
        input_ids = torch.tensor([prompt_ids])
        output = self._generate(input_ids, num_output_tokens, streamer=clock)
        e2e_s = time.perf_counter() - start
        return StreamTiming(clock.first_s, e2e_s, output.shape[1] - input_ids.shape[1])

    @torch.inference_mode()
    def batch(self, prompts: list[list[int]], num_output_tokens: int) -> tuple[int, float]:
        start = time.perf_counter()
        input_ids = torch.tensor(prompts)
        output = self._generate(input_ids, num_output_tokens)
        wall_s = time.perf_counter() - start
        return output.shape[0] * (output.shape[1] - input_ids.shape[1]), wall_s


def random_prompts(rng: random.Random, num_prompts: int, num_tokens: int) -> list[list[int]]:
    return [
        [rng.randrange(*PROMPT_TOKEN_RANGE) for _ in range(num_tokens)] for _ in range(num_prompts)
    ]


def warm_up(engine) -> None:
    """Every timed shape once (short outputs), so no kernel set-up lands in the first repeat."""
    rng = random.Random(SEED - 1)  # ids of their own: no timed prompt is ever seen twice
    for num_tokens in TTFT_PROMPT_TOKENS:
        engine.first_token(random_prompts(rng, 1, num_tokens)[0])
    engine.stream(random_prompts(rng, 1, STREAM_PROMPT_TOKENS)[0], 16)
    engine.batch(random_prompts(rng, BATCH_SIZE, BATCH_PROMPT_TOKENS), 8)


def machine_busy_s() -> Optional[float]:
    """CPU seconds all processes have spent busy since boot (None where /proc/stat is missing)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle_ticks = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle_ticks) / os.sysconf("SC_CLK_TCK")


def measure_once(engine, rng_seed: int) -> tuple[dict[str, float], list[int]]:
    """One sample of every metric; also the first greedy token of each TTFT prompt.

    `others_cpu_share` is the fraction of the machine's CPU time that other processes used
    meanwhile: on a shared machine it says how far to trust the sample.
    """
    start_wall_s, start_own_s, start_busy_s = (
        time.perf_counter(),
        time.process_time(),
        machine_busy_s(),
    )
    rng = random.Random(rng_seed)
    sample: dict[str, float] = {}
    first_tokens = []
    for num_tokens in TTFT_PROMPT_TOKENS:
        gc.collect()
        ttft_s, token = engine.first_token(random_prompts(rng, 1, num_tokens)[0])
        sample[f"ttft_{num_tokens}_ms"] = ttft_s * 1e3
        first_tokens.append(token)
    gc.collect()
    timing = engine.stream(random_prompts(rng, 1, STREAM_PROMPT_TOKENS)[0], STREAM_OUTPUT_TOKENS)
    if timing.num_output_tokens != STREAM_OUTPUT_TOKENS:
        raise RuntimeError(
            f"{engine.name} produced {timing.num_output_tokens} tokens, asked for "
            f"{STREAM_OUTPUT_TOKENS}"
        )
    sample["tpot_ms"] = timing.tpot_s * 1e3
    gc.collect()
    num_tokens, wall_s = engine.batch(
        random_prompts(rng, BATCH_SIZE, BATCH_PROMPT_TOKENS), BATCH_OUTPUT_TOKENS
    )
    if num_tokens != BATCH_SIZE * BATCH_OUTPUT_TOKENS:
        raise RuntimeError(
            f"{engine.name} produced {num_tokens} tokens, asked for "
            f"{BATCH_SIZE * BATCH_OUTPUT_TOKENS}"
        )
    sample["throughput_tok_s"] = num_tokens / wall_s
    if start_busy_s is not None:
        others_s = machine_busy_s() - start_busy_s - (time.process_time() - start_own_s)
        sample["others_cpu_share"] = max(0.0, others_s) / (
            (time.perf_counter() - start_wall_s) * os.cpu_count()
        )
    return sample, first_tokens


def bench_dtype(dtype: str, repeats: int) -> dict:
    engines = []
    for cls in (OurEngine, HFReference):
        start = time.perf_counter()
        engine = cls(dtype)
        load_s = time.perf_counter() - start
        warm_up(engine)
        print(
            f"[{dtype}] {engine.name}: loaded in {load_s:.1f} s, warmed up in "
            f"{time.perf_counter() - start - load_s:.1f} s",
            flush=True,
        )
        engines.append(engine)
    samples: dict[str, list[dict[str, float]]] = {engine.name: [] for engine in engines}
    agree = total = 0
    for repeat in range(repeats):
        first_tokens = {}
        # neither engine always runs on a warmer machine
        order = engines if repeat % 2 == 0 else engines[::-1]
        for engine in order:
            sample, first_tokens[engine.name] = measure_once(engine, SEED + repeat)
            samples[engine.name].append(sample)
            print(
                f"[{dtype}] repeat {repeat + 1}/{repeats} {engine.name}: "
                + ", ".join(f"{k}={v:.2f}" for k, v in sample.items()),
                flush=True,
            )
        ours, ref = (first_tokens[engine.name] for engine in engines)
        agree += sum(a == b for a, b in zip(ours, ref))
        total += len(ours)
    medians = {
        name: {m: statistics.median(s[m] for s in runs) for m in METRICS}
        for name, runs in samples.items()
    }
    return {"samples": samples, "median": medians, "first_token_agreement": [agree, total]}


def speedup(metric: str, ours: float, reference: float) -> float:
    """> 1 means ours is better: latency ratios are HF / ours, throughput ratios ours / HF."""
    return ours / reference if metric.endswith("tok_s") else reference / ours


def markdown_table(results: dict[str, dict]) -> str:
    lines = ["| engine | " + " | ".join(HEADERS) + " |", "|---|" + "---|" * len(HEADERS)]
    short = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}
    for dtype, result in results.items():
        ours, reference = (result["median"][cls.name] for cls in (OurEngine, HFReference))
        for name, values in ((OurEngine.name, ours), (HFReference.name, reference)):
            cells = [
                f"{values[m]:.0f}" if m.endswith("tok_s") else f"{values[m]:.1f} ms"
                for m in METRICS
            ]
            lines.append(f"| {name} {short.get(dtype, dtype)} | " + " | ".join(cells) + " |")
        cells = [f"**{speedup(m, ours[m], reference[m]):.2f}×**" for m in METRICS]
        lines.append(f"| ours vs HF, {short.get(dtype, dtype)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def the_command() -> str:
    python = (
        os.path.relpath(sys.executable)
        if sys.executable.startswith(os.getcwd() + os.sep)
        else sys.executable
    )
    return shlex.join([python, "-m", "benchmarks.engine_bench", *sys.argv[1:]])


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.engine_bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--dtypes", default="bfloat16,float32", help="comma-separated: bfloat16, float32, float16"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="samples per metric; the median is reported"
    )
    parser.add_argument("--json", type=Path, help="also write the medians and every sample here")
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 repeat, bfloat16 only")
    args = parser.parse_args(argv)
    dtypes = (
        ["bfloat16"] if args.quick else [d.strip() for d in args.dtypes.split(",") if d.strip()]
    )
    repeats = 1 if args.quick else args.repeats
    if repeats < 1:
        parser.error("--repeats must be >= 1")

    torch.set_num_threads(NUM_THREADS)
    import transformers

    env = {
        "command": the_command(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": NUM_THREADS,
        "load_average_at_start": os.getloadavg(),
    }
    start = time.perf_counter()
    results = {dtype: bench_dtype(dtype, repeats) for dtype in dtypes}
    env["load_average_at_end"] = os.getloadavg()
    env["wall_s"] = round(time.perf_counter() - start, 1)

    print()
    print(f"Command: `{env['command']}`  ")
    print(
        f"torch {env['torch']}, transformers {env['transformers']}, CPU: {env['cpu']} "
        f"({env['cpu_count']} logical CPUs), torch threads: {NUM_THREADS}, repeats: {repeats} "
        "(median shown)  "
    )
    print(
        "load average (1/5/15 min) at start {:.2f}/{:.2f}/{:.2f}, at end {:.2f}/{:.2f}/{:.2f}; "
        "wall {} s".format(
            *env["load_average_at_start"], *env["load_average_at_end"], env["wall_s"]
        )
    )
    print()
    print(markdown_table(results))
    print()
    print("Ratios: > 1 means ours is better (latency: HF / ours; throughput: ours / HF).")
    for dtype, result in results.items():
        agree, total = result["first_token_agreement"]
        print(f"{dtype}: the first greedy token agrees on {agree}/{total} TTFT prompts.")
        shares = {
            name: [f"{s['others_cpu_share']:.0%}" for s in runs if "others_cpu_share" in s]
            for name, runs in result["samples"].items()
        }
        print(
            f"{dtype}: share of the machine's CPU other processes used, per repeat: "
            + "; ".join(f"{name} {', '.join(values)}" for name, values in shares.items())
        )
    if args.json:
        args.json.write_text(json.dumps({"environment": env, "results": results}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
