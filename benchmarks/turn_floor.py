"""The compute floor of a conversation's later turn on this machine (issue #16): how long the engine
takes to prefill a turn's new tokens on top of a cached history, and one decode step of a batch of
such conversations, with 1 and with 2 torch threads. A disaggregated or colocated pdserve worker on
2 cores computes with 1 thread; vLLM-CPU with both.

    .venv/bin/python -m benchmarks.turn_floor [--history 600] [--new 140] [--batch 8] [--repeats 5]

Each repeat: a fresh engine (fp32, the default model) prefills the history, then a prompt of history
+ `--new` tokens (the history's blocks are found in its prefix cache: only the new tokens are
computed; timed); then `--batch` such sequences decode one step together (timed: the median of 8
steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from engine.weights import load_model


def _prefill_new_tokens_s(engine: LLMEngine, history: list[int], new: list[int], tag: str) -> float:
    greedy = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine.add_request(f"{tag}-history", history, greedy)
    list(engine.run_until_done())
    start = time.perf_counter()
    engine.add_request(f"{tag}-turn", history + new, greedy)
    outputs = list(engine.run_until_done())
    elapsed = time.perf_counter() - start
    assert outputs[-1].num_cached_prompt_tokens >= len(history) - engine.config.block_size_tokens
    return elapsed


def _decode_step_s(engine: LLMEngine, prompts: list[list[int]]) -> float:
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"decode-{index}", prompt, params)
    while engine.scheduler.waiting:
        engine.step()  # prefills
    steps = []
    for _ in range(8):
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    for index in range(len(prompts)):
        engine.abort(f"decode-{index}")
    return statistics.median(steps)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--history", type=int, default=600)
    parser.add_argument("--new", type=int, default=140)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    loaded = load_model("default", torch.float32)
    generator = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    report = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "args": vars(args),
        "threads": {},
    }
    for threads in (1, 2):
        torch.set_num_threads(threads)
        prefill, decode = [], []
        for repeat in range(args.repeats):
            ids = torch.randint(
                100, vocab, (args.batch + 1, args.history + args.new), generator=generator
            ).tolist()
            engine = LLMEngine(
                EngineConfig(dtype="float32", num_threads=threads, kv_cache_bytes=1 << 30),
                loaded=loaded,
            )
            prefill.append(
                _prefill_new_tokens_s(
                    engine, ids[0][: args.history], ids[0][args.history :], str(repeat)
                )
            )
            decode.append(_decode_step_s(engine, [row[: args.history] for row in ids[1:]]))
        report["threads"][threads] = {
            "prefill_new_tokens_ms": round(statistics.median(prefill) * 1e3, 1),
            "decode_step_ms": round(statistics.median(decode) * 1e3, 1),
        }
        print(
            f"{threads} thread(s): prefill of {args.new} new tokens on a {args.history}-token "
            f"cached history {report['threads'][threads]['prefill_new_tokens_ms']} ms; decode "
            f"step of {args.batch} such sequences {report['threads'][threads]['decode_step_ms']} "
            "ms"
        )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
